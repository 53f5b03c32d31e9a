"""Live check: a real Prometheus scrapes a running infertap (in front of its simulated engine, which is
scraped too), a short load goes through, and then every PromQL expression of every dashboard panel and
every rule must be valid, and return data where the load made some.

Legitimately empty (listed in EMPTY_OK below, with the reason): comparisons with 1 day and 1 week ago
(no history yet), series of outcomes that a healthy run does not produce (interrupted streams, idle
timeouts, disconnects, timeouts, retries), and every alert expression (no alert should fire).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import tool
from tests.live_stack import stop, wait_for

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules"
REQUESTS = 20
MODEL = "sim-model"
UNPRICED = "unpriced-model"  # one request, so that infertap_unpriced_tokens_total has a series

# (dashboard file stem, panel title) -> why its queries may return nothing after a short healthy load
EMPTY_OK = {
    ("infertap-overview", "Interrupted streams and client disconnects"): "no stream breaks in a healthy run",
    ("infertap-prefill-decode", "TTFT p95: now, 1 day and 1 week earlier"): "offset 1d/1w: no history yet",
    ("infertap-prefill-decode", "What the TTFT regression alert sees"): "1d/1w-ago baselines: no history yet",
    ("infertap-overview", "Client mistakes/s"): "no bad requests in a healthy run",
    ("infertap-overview", "Requests without usage"): "the simulated engine always sends usage",
    ("infertap-fleet", "Ejected or draining replicas"): "no replica is ejected in a healthy run",
    ("infertap-fleet", "Failed requests/s per replica"): "no request fails in a healthy run",
}
# metric names that appear only after their event (prometheus-client exposes a labelled child once used)
ON_EVENT = {"infertap_requests_without_usage_total": "an answer without usage; the sim always sends it"}
EMPTY_OK_EXPR = (
    "offset 1d",
    "offset 1w",
    "_1d_ago",
    "_1w_ago",
    "infertap_timeouts_total",
    "infertap_retries_total",
    'outcome!~"ok|client_error|client_disconnect|rejected"',
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    prometheus = tool("prometheus")
    if not shutil.which("promtool") and os.environ.get("CI") != "true":
        pytest.skip("promtool is not installed")
    tmp = tmp_path_factory.mktemp("live")
    procs: list[subprocess.Popen[Any]] = []
    logs = ExitStack()
    try:
        sim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "sim",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--model",
                MODEL,
                "--model",
                UNPRICED,
            ],
            stdout=subprocess.PIPE,
            stderr=logs.enter_context(open(tmp / "sim.log", "w")),
            text=True,
            cwd=ROOT,
        )
        procs.append(sim)
        assert sim.stdout is not None
        ready, _, _ = select.select([sim.stdout], [], [], 30)
        assert ready, "the simulated engine did not start in 30 s"
        line = sim.stdout.readline()
        assert line.startswith("infertap-sim listening on "), line
        engine_url = line.split(" on ", 1)[1].strip()
        engine_hostport = engine_url.split("://", 1)[1].split("/", 1)[0]

        port = free_port()
        env = {
            **os.environ,
            # A pool (of one replica) so that the Fleet dashboard's and rules' replica series exist.
            "INFERTAP_UPSTREAMS": json.dumps(
                [{"name": "sim", "replicas": [engine_url], "balance": "prefix_affinity"}]
            ),
            # Prices for the sim's model (the spend panels and alert get data); UNPRICED has none.
            "INFERTAP_SPEND__PRICES": json.dumps(
                [{"models": ["sim-*"], "input_per_mtok": 1.0, "output_per_mtok": 2.0}]
            ),
            "INFERTAP_SPEND__DAILY_BUDGET": "1000",
        }
        env.pop("TAOTOKEN_API_KEY", None)
        proxy = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stdout=logs.enter_context(open(tmp / "proxy.log", "w")),
            stderr=subprocess.STDOUT,
        )
        procs.append(proxy)
        base = f"http://127.0.0.1:{port}"
        wait_for("infertap /readyz", lambda: httpx.get(f"{base}/readyz", timeout=2).status_code == 200, 30)

        prom_port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES / "*.yml")],
            "scrape_configs": [
                {"job_name": "infertap", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
                {
                    "job_name": "engine",
                    "static_configs": [{"targets": [engine_hostport]}],
                    # the same relabelling as deploy/prometheus/prometheus.yml (colons escaped in OpenMetrics)
                    "metric_relabel_configs": [
                        {
                            "source_labels": ["__name__"],
                            "regex": "vllm_(.+)",
                            "target_label": "__name__",
                            "replacement": "vllm:$1",
                        }
                    ],
                },
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--enable-feature=exemplar-storage",
            ],
            cwd=tmp,
            stdout=logs.enter_context(open(tmp / "prometheus.log", "w")),
            stderr=subprocess.STDOUT,
        )
        procs.append(prom)
        api = f"http://127.0.0.1:{prom_port}"
        wait_for("Prometheus ready", lambda: httpx.get(f"{api}/-/ready", timeout=2).status_code == 200, 60)
        yield {"proxy": base, "api": api, "logs": str(tmp)}
    finally:
        for p in reversed(procs):
            stop(p)
        logs.close()


def query(api: str, expr: str) -> dict[str, Any]:
    r = httpx.get(f"{api}/api/v1/query", params={"query": expr}, timeout=10)
    body: dict[str, Any] = r.json()
    return body


def values(api: str, expr: str) -> list[Any]:
    body = query(api, expr)
    assert body["status"] == "success", body
    result: list[Any] = body["data"]["result"]
    return result


@pytest.fixture(scope="module")
def loaded(stack: dict[str, str]) -> dict[str, str]:
    api = stack["api"]
    # Both targets scraped before the load, so that rate() sees the counters grow.
    wait_for("both targets up", lambda: len(values(api, "up == 1")) == 2, 30)
    prompts = ["Hello!", "Explain prefill and decode. " * 300]  # a <1k and a 1k-4k prompt
    with httpx.Client(base_url=stack["proxy"], timeout=60) as client:
        for i in range(REQUESTS):
            body = {
                "model": MODEL,
                "stream": True,
                "max_tokens": 16,
                "messages": [{"role": "user", "content": prompts[i % 2]}],
            }
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                text = "".join(r.iter_text())
            assert "data: [DONE]" in text
        body = {"model": UNPRICED, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    wait_for(
        "the load scraped",
        lambda: values(api, f"sum(infertap_time_to_first_token_seconds_count) >= {REQUESTS}"),
        30,
    )
    wait_for(
        "the engine's counts scraped",
        lambda: values(api, f"sum(vllm:time_to_first_token_seconds_count) >= {REQUESTS}"),
        30,
    )
    wait_for(
        "recording rules evaluated",
        lambda: values(
            api, "model_upstream_prompt_class:infertap_time_to_first_token_seconds_count:rate30m > 0"
        ),
        30,
    )
    wait_for("SLO rules evaluated", lambda: values(api, "model:infertap_ttft_slo_errors:ratio_rate5m"), 30)
    return stack


def substitute(expr: str) -> str:
    for var in ("$__rate_interval", "$model_name", "$model", "$upstream", "$job", "$namespace", "$instance"):
        expr = expr.replace(var, "1m" if var == "$__rate_interval" else ".*")
    return expr


def dashboard_queries() -> list[tuple[str, str, str, str]]:
    out = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel.get("targets", []):
                out.append((path.stem, panel["title"], t["refId"], t["expr"]))
    return out


def rule_exprs() -> list[tuple[str, str, str]]:
    out = []
    for f in sorted(RULES.glob("*.yml")):
        for g in yaml.safe_load(f.read_text())["groups"]:
            for r in g["rules"]:
                out.append(("alert" if "alert" in r else "record", r.get("alert") or r["record"], r["expr"]))
    return out


def test_every_dashboard_query_is_valid_and_has_data(loaded: dict[str, str]) -> None:
    empty, invalid = [], []
    for stem, title, ref, expr in dashboard_queries():
        body = query(loaded["api"], substitute(expr))
        if body["status"] != "success":
            invalid.append(f"{stem} / {title} / {ref}: {body.get('error')}")
        elif (
            not body["data"]["result"]
            and (stem, title) not in EMPTY_OK
            and not any(s in expr for s in EMPTY_OK_EXPR)
        ):
            empty.append(f"{stem} / {title} / {ref}: {expr}")
    assert not invalid, "\n".join(invalid)
    assert not empty, "no data after the load:\n" + "\n".join(empty)


def test_every_rule_expression_is_valid(loaded: dict[str, str]) -> None:
    empty, invalid = [], []
    for kind, name, expr in rule_exprs():
        body = query(loaded["api"], expr)
        if body["status"] != "success":
            invalid.append(f"{name}: {body.get('error')}")
        elif (
            kind == "record"
            and not body["data"]["result"]
            and not any(s in name + expr for s in EMPTY_OK_EXPR)
        ):
            empty.append(name)
    assert not invalid, "\n".join(invalid)
    assert not empty, "recording rules without data after the load: " + ", ".join(empty)


def test_prometheus_loaded_the_rules_and_nothing_fires(loaded: dict[str, str]) -> None:
    r = httpx.get(f"{loaded['api']}/api/v1/rules", timeout=10).json()
    groups = {g["name"]: g for g in r["data"]["groups"]}
    assert set(groups) >= {
        "infertap-baselines",
        "infertap-ttft-slo",
        "infertap-latency",
        "infertap-errors",
        "infertap-availability",
        "infertap-ttft-slo-burn",
    }
    health = [
        (rule["name"], rule.get("lastError"))
        for g in groups.values()
        for rule in g["rules"]
        if rule.get("health") == "err"
    ]
    assert not health, health
    firing = values(loaded["api"], 'ALERTS{alertstate="firing"}')
    assert not firing, firing


def test_scraped_names_match_metric_names_txt(loaded: dict[str, str]) -> None:
    api = loaded["api"]
    listed = {
        ln.strip()
        for ln in (ROOT / "deploy/metric_names.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    }
    scraped = set(httpx.get(f"{api}/api/v1/label/__name__/values", timeout=10).json()["data"])
    assert listed - set(ON_EVENT) <= scraped, sorted(listed - scraped)
    engine = {
        ln.strip()
        for ln in (ROOT / "deploy/engine_metric_names.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    }
    assert engine <= scraped, sorted(engine - scraped)


def test_exemplars_reach_prometheus(loaded: dict[str, str]) -> None:
    """TTFT exemplars carry a trace id, which Grafana links to the trace datasource. infertap attaches
    them only when a request is traced: without a tracer configured this run may have none."""
    r = httpx.get(
        f"{loaded['api']}/api/v1/query_exemplars",
        timeout=10,
        params={
            "query": "infertap_time_to_first_token_seconds_bucket",
            "start": time.time() - 600,
            "end": time.time(),
        },
    )
    body = r.json()
    assert body["status"] == "success", body
    for series in body["data"]:
        for ex in series["exemplars"]:
            assert "trace_id" in ex["labels"], ex
