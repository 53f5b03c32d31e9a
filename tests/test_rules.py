"""Prometheus rules: promtool check and unit tests, the generated files, annotations and runbook anchors."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import tool

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests"
DOCS = ROOT / "docs" / "monitoring.md"


def load_generate() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_generate", ROOT / "deploy" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load((RULES / "infertap-alerts.yml").read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_promtool_check_rules() -> None:
    files = sorted(str(p) for p in RULES.glob("*.yml"))
    r = subprocess.run(
        [tool("promtool"), "check", "rules", *files], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_config(tmp_path: Path) -> None:
    # The compose stack's Prometheus config (rule_files resolve inside the container: checked above).
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    cfg["rule_files"] = [str(RULES / "*.yml")]
    tmp = tmp_path / "prometheus.yml"
    tmp.write_text(yaml.safe_dump(cfg))
    r = subprocess.run(
        [tool("promtool"), "check", "config", str(tmp)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.timeout(600)
def test_promtool_test_rules() -> None:
    """Every unit test file, run in parallel (the 8-day ones take about 25 s each)."""
    promtool = tool("promtool")
    files = sorted(RULE_TESTS.glob("*.test.yml"))
    assert len(files) >= 4
    procs = {
        f.name: subprocess.Popen(
            [promtool, "test", "rules", f.name],
            cwd=RULE_TESTS,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for f in files
    }
    failures = {}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=540)
        if p.returncode != 0:
            failures[name] = out[-4000:]
    assert not failures, "\n".join(f"== {k}\n{v}" for k, v in failures.items())


def test_generated_files_are_up_to_date(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_generate().main(["--check"]) == 0, capsys.readouterr().out


def test_prometheusrule_holds_the_same_rules() -> None:
    doc = yaml.safe_load((ROOT / "deploy/kubernetes/prometheusrule.yaml").read_text())
    assert doc["kind"] == "PrometheusRule"
    assert doc["spec"]["groups"] == load_generate().rule_groups()


def test_every_alert_has_summary_description_and_a_runbook_that_exists() -> None:
    anchors = github_anchors(DOCS.read_text())
    base = load_generate().DEFAULT_RUNBOOK_BASE
    assert base.startswith("https://") and base.endswith("/docs/monitoring.md")
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)) >= 10
    for a in alerts():
        ann = a["annotations"]
        assert ann["summary"] and ann["description"], a["alert"]
        # absolute: a relative link means nothing in a pager or a Slack message
        page, _, anchor = ann["runbook_url"].partition("#")
        assert page == base, a["alert"]
        assert anchor in anchors, f"{a['alert']}: no heading in docs/monitoring.md gives #{anchor}"
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        assert "$value" not in str(ann), "annotations use labels only: the unit tests assert them exactly"


def test_every_alert_is_tested_firing_and_every_silent_scenario_checks_every_alert() -> None:
    spec = importlib.util.spec_from_file_location("scenarios", RULE_TESTS / "scenarios.py")
    assert spec and spec.loader
    scenarios = importlib.util.module_from_spec(spec)
    sys.modules["scenarios"] = scenarios
    spec.loader.exec_module(scenarios)
    fired = {alert for _, _, _, cases in scenarios.FILES.values() for *_, firing in cases for alert in firing}
    assert fired == {a["alert"] for a in alerts()}
    silent = [c[0] for c in scenarios.FILES["silent.test.yml"][3]]
    assert silent == [
        "steady traffic",
        "low traffic that goes bad",
        "the same weekly pattern as last week",
        "prompts getting longer",
    ]
    doc = yaml.safe_load((RULE_TESTS / "silent.test.yml").read_text())
    for test in doc["tests"]:
        checked = {t["alertname"] for t in test["alert_rule_test"]}
        assert checked == {a["alert"] for a in alerts()}, test["name"]
        assert all(t["exp_alerts"] == [] for t in test["alert_rule_test"]), test["name"]


def test_alertmanager_config() -> None:
    cfg = ROOT / "deploy/alertmanager/alertmanager.yml"
    amtool = shutil.which("amtool")
    if amtool:
        r = subprocess.run([amtool, "check-config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    doc = yaml.safe_load(cfg.read_text())
    known = {a["alert"] for a in alerts()}
    for rule in doc["inhibit_rules"]:
        for m in rule["source_matchers"] + rule["target_matchers"]:
            names = re.findall(r"Infertap\w+", m)
            assert names and set(names) <= known, m


def test_generate_writes_a_copy_with_another_runbook_base_or_at_a_time_scale(tmp_path: Path) -> None:
    gen = load_generate()
    assert gen.main(["--out", str(tmp_path), "--runbook-base", "https://wiki.example.com/llm"]) == 0
    groups = yaml.safe_load((tmp_path / "infertap-rules.yml").read_text())["groups"]
    urls = [r["annotations"]["runbook_url"] for g in groups for r in g["rules"] if "alert" in r]
    assert urls and all(u.startswith("https://wiki.example.com/llm#infertap") for u in urls)
    # the rest is unchanged
    for mine, shipped in zip(groups, gen.rule_groups(), strict=True):
        for r, o in zip(mine["rules"], shipped["rules"], strict=True):
            assert r["expr"] == o["expr"] and r.get("for") == o.get("for")

    scaled_dir = tmp_path / "scaled"
    assert gen.main(["--out", str(scaled_dir), "--time-scale", "120"]) == 0
    scaled = yaml.safe_load((scaled_dir / "infertap-rules.yml").read_text())["groups"]
    ttft = next(r for g in scaled for r in g["rules"] if r.get("alert") == "InfertapTTFTRegression")
    assert ttft["for"] == "7500ms"
    assert all(g["interval"] == "250ms" for g in scaled)
    p95 = next(r for g in scaled for r in g["rules"] if r.get("record", "").endswith(":p95_30m_1w_ago"))
    assert "[15s] offset 84m" in p95["expr"].replace("\n", " ")
    am = yaml.safe_load((scaled_dir / "alertmanager.yml").read_text())
    assert (am["route"]["group_wait"], am["route"]["group_interval"]) == ("250ms", "2500ms")
    r = subprocess.run(
        [tool("promtool"), "check", "rules", str(scaled_dir / "infertap-rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert gen.scale_expr("rate(x[1h:5m] offset 1d)", 60) == "rate(x[1m:5s] offset 24m)"
    with pytest.raises(SystemExit):
        gen.main(["--time-scale", "10"])  # a scaled copy never overwrites the shipped rules


def test_fleet_alert_has_a_runbook_a_ticket_severity_and_a_firing_test() -> None:
    """InfertapReplicaSlow lives in its own file (its recording rules and tests with it): the same
    conventions as infertap-alerts.yml, and each of its alerts fires in fleet.test.yml."""
    groups = yaml.safe_load((RULES / "infertap-fleet.yml").read_text())["groups"]
    rules = [r for g in groups for r in g["rules"] if "alert" in r]
    assert [r["alert"] for r in rules] == ["InfertapReplicaSlow"]
    anchors = github_anchors(DOCS.read_text())
    base = load_generate().DEFAULT_RUNBOOK_BASE
    for a in rules:
        ann = a["annotations"]
        page, _, anchor = ann["runbook_url"].partition("#")
        assert page == base and anchor in anchors, a["alert"]
        assert ann["summary"] and ann["description"] and "$value" not in str(ann), a["alert"]
        # One sick replica of several: the others serve and the balancer avoids it; a ticket.
        assert a["labels"]["severity"] == "warning", a["alert"]
    doc = yaml.safe_load((RULE_TESTS / "fleet.test.yml").read_text())
    fired = {t["alertname"] for test in doc["tests"] for t in test["alert_rule_test"] if t["exp_alerts"]}
    assert fired == {a["alert"] for a in rules}
    silent = [
        test["name"] for test in doc["tests"] if not any(t["exp_alerts"] for t in test["alert_rule_test"])
    ]
    assert len(silent) >= 3, "the whole pool slow, low traffic and the floor stay silent"
