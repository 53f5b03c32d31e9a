"""Every metric name that dashboards/ and deploy/ use exists in deploy/metric_names.txt (infertap) or
deploy/engine_metric_names.txt (vLLM / the simulated engine). The metrics tests check those files
against the real /metrics, so a renamed metric cannot silently blank a panel or mute an alert."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def names(path: Path) -> set[str]:
    return {ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")}


def recorded() -> set[str]:
    out = set()
    for f in (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"):
        for g in yaml.safe_load(f.read_text())["groups"]:
            out |= {r["record"] for r in g["rules"] if "record" in r}
    return out


def artifacts() -> list[Path]:
    files = list((ROOT / "dashboards").glob("*.json"))
    for ext in ("*.yml", "*.yaml", "*.json"):
        files += [p for p in (ROOT / "deploy").rglob(ext) if p.name != "dashboard.schema.json"]
    return sorted(files)


def used(text: str) -> set[str]:
    for rec in sorted(recorded(), key=len, reverse=True):
        text = text.replace(rec, " ")
    return set(re.findall(r"\b(?:infertap_[a-z0-9_]+|vllm:[a-z0-9_:]+)", text))


def test_metric_name_files_are_well_formed() -> None:
    infertap = names(ROOT / "deploy" / "metric_names.txt")
    engine = names(ROOT / "deploy" / "engine_metric_names.txt")
    assert infertap and all(n.startswith("infertap_") for n in infertap)
    assert engine and all(n.startswith("vllm:") for n in engine)
    for n in infertap | engine:
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", n), n


def test_every_used_metric_is_known() -> None:
    known = names(ROOT / "deploy" / "metric_names.txt") | names(ROOT / "deploy" / "engine_metric_names.txt")
    unknown = {}
    seen: set[str] = set()
    for path in artifacts():
        found = used(path.read_text())
        seen |= found
        if found - known:
            unknown[str(path.relative_to(ROOT))] = sorted(found - known)
    assert not unknown, unknown
    assert "infertap_time_to_first_token_seconds_bucket" in seen and "vllm:kv_cache_usage_perc" in seen
    # recording rules keep the level:metric:operations form, so they never read as raw names
    assert all(r.count(":") == 2 for r in recorded())
