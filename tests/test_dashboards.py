"""Grafana dashboards: Grafana's own dashboard schema, and the conventions the stack relies on."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
SCHEMA = ROOT / "deploy" / "grafana" / "dashboard.schema.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_five_dashboards() -> None:
    assert [p.name for p in DASHBOARDS] == [
        "infertap-engine.json",
        "infertap-fleet.json",
        "infertap-overview.json",
        "infertap-prefill-decode.json",
        "infertap-usage-spend.json",
    ]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_valid_against_grafana_schema(path: Path) -> None:
    try:
        import jsonschema
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("jsonschema is missing in CI: scripts/install_deploy_tools.sh installs it")
        pytest.skip("jsonschema is not installed (run scripts/install_deploy_tools.sh)")
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(load(path)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message[:300]}" for e in errors[:10])


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_conventions(path: Path) -> None:
    dash = load(path)
    assert dash["schemaVersion"] >= 39
    assert dash["uid"] == path.stem and len(dash["uid"]) <= 40
    names = [v["name"] for v in dash["templating"]["list"]]
    engine = ["model_name", "instance"] if path.stem in ("infertap-engine", "infertap-fleet") else []
    assert names == ["datasource", "job", "namespace", "model", "upstream", *engine]
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        assert p.get("title"), p
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] in ("row", "text"):
            continue
        assert p.get("description"), f"{p['title']}: every panel says what it means"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and refs, p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            uses = ("$model", "$upstream", "$job", "infertap_build_info")
            assert any(u in t["expr"] for u in uses), (
                f"{p['title']}: {t['expr']} ignores the dashboard's variables"
            )


def test_ttft_and_e2e_panels_show_exemplars_linked_to_traces() -> None:
    exemplar_metrics = set()
    for path in DASHBOARDS:
        for p in panels(load(path)):
            for t in p.get("targets", []):
                if t.get("exemplar"):
                    exemplar_metrics |= set(re.findall(r"infertap_\w+_bucket", t["expr"]))
    assert exemplar_metrics == {
        "infertap_time_to_first_token_seconds_bucket",
        "infertap_request_duration_seconds_bucket",
    }
    ds = yaml.safe_load((PROVISIONING / "datasources" / "datasources.yml").read_text())["datasources"]
    by_uid = {d["uid"]: d for d in ds}
    dest = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert dest == [{"name": "trace_id", "datasourceUid": "jaeger"}]
    assert by_uid["jaeger"]["type"] == "jaeger"


def test_engine_dashboard_names_the_five_faults() -> None:
    dash = load(ROOT / "dashboards" / "infertap-engine.json")
    text = json.dumps(dash)
    for n in range(1, 6):
        assert f"Fault {n}," in text


def test_required_panels() -> None:
    titles = {path.stem: {p["title"] for p in panels(load(path))} for path in DASHBOARDS}
    assert {
        "Requests/s by outcome",
        "Error and timeout ratio",
        "In-flight requests",
        "Time to first token",
        "Time per output token",
        "Inter-token latency",
        "End-to-end duration",
        "Tokens/s",
        "Interrupted streams and client disconnects",
    } <= titles["infertap-overview"]
    assert {
        "TTFT heatmap",
        "TTFT p95 by prompt class",
        "Prefix cache hit ratio",
        "TTFB vs TTFT",
        "Output length distribution",
        "TTFT p95: now, 1 day and 1 week earlier",
    } <= titles["infertap-prefill-decode"]
    assert {
        "TTFT: engine vs proxy (p95)",
        "Requests waiting and running",
        "KV cache usage",
        "Prefix cache hit rate",
        "Preemptions/s",
    } <= titles["infertap-engine"]
    assert {
        "Spend rate per client (per day)",
        "Spend/s by model",
        "Prompt tokens/s by client",
        "Prefix cache hit ratio by model",
        "Reasoning share by model",
    } <= titles["infertap-usage-spend"]
    assert {
        "Requests/s per replica",
        "In-flight requests per replica",
        "TTFT p95 per replica vs the pool's median",
        "Ejected or draining replicas",
        "Affinity hit rate",
        "Engine prefix cache hit rate per instance",
    } <= titles["infertap-fleet"]


def test_provisioning_points_at_the_dashboards() -> None:
    prov = yaml.safe_load((PROVISIONING / "dashboards" / "dashboards.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert f"./dashboards:{path}:ro" in compose["services"]["grafana"]["volumes"]
    assert (
        "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro"
        in compose["services"]["grafana"]["volumes"]
    )


def test_kubernetes_copies_are_identical() -> None:
    for path in DASHBOARDS:
        assert (ROOT / "deploy" / "kubernetes" / "dashboards" / path.name).read_text() == path.read_text()


def test_stat_panels_have_thresholds_and_the_error_ratio_is_zero_when_healthy() -> None:
    """Without thresholds Grafana's default turns a stat red at 80 (Requests/s!); and with no failure
    yet only outcome="ok" exists, so a plain ratio shows "No data" on a healthy system."""
    for path in DASHBOARDS:
        for p in panels(load(path)):
            if p["type"] == "stat":
                steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
                assert steps[0]["value"] is None and all(s["value"] is not None for s in steps[1:]), p[
                    "title"
                ]
    overview = {p["title"]: p for p in panels(load(ROOT / "dashboards" / "infertap-overview.json"))}
    ratio = overview["Error ratio"]
    assert "or vector(0)" in ratio["targets"][0]["expr"]
    assert [s["color"] for s in ratio["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [
        "green",
        "yellow",
        "red",
    ]
    assert [s["color"] for s in overview["Requests/s"]["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [
        "green"
    ]
    assert "rejected" in ratio["targets"][0]["expr"]  # client mistakes are not errors (as in the alert)
    assert overview["Tokens/s"]["fieldConfig"]["defaults"]["unit"] == "suffix: tokens/s"


# infertap's own cost has no model label: it is the same whatever the model.
QUANTILE = re.compile(r"histogram_quantile\([\d.]+, sum by \(([^)]*)\) \(rate\((\w+)")
OWN_COST = {"infertap_overhead_seconds_bucket", "infertap_event_loop_lag_seconds_bucket"}


def test_latency_quantiles_never_mix_models_and_engine_panels_use_instance() -> None:
    for path in DASHBOARDS:
        for p in panels(load(path)):
            for t in p.get("targets", []):
                for m in QUANTILE.finditer(t["expr"]):
                    if m.group(2) in OWN_COST:
                        continue
                    by = {x.strip() for x in m.group(1).split(",")}
                    if m.group(2).startswith("infertap_replica_"):  # a pool is one upstream: no model label
                        assert {"upstream", "replica"} <= by, f"{path.stem} / {p['title']}: {t['expr']}"
                        continue
                    assert by & {"model", "model_name"}, f"{path.stem} / {p['title']}: {t['expr']}"
                # every vLLM replica reports engine="0": group by instance instead
                assert "by (engine)" not in t["expr"], p["title"]
                if "vllm:" in t["expr"]:
                    assert "$model_name" in t["expr"] and "$instance" in t["expr"], p["title"]


def test_sre_panels() -> None:
    titles = {path.stem: {p["title"] for p in panels(load(path))} for path in DASHBOARDS}
    assert {
        "Burn rate (1h)",
        "Error budget left (3 days)",
        "Requests missing the TTFT objective",
        "Requests/s by route",
        "Requests without usage",
    } <= titles["infertap-overview"]
    assert "Finish reasons (stop vs length)" in titles["infertap-engine"]
    assert "TTFT per prompt token: now, 1 day and 1 week earlier" in titles["infertap-prefill-decode"]
