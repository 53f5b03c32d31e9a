"""`infertap doctor` against real servers: each of the seed's five faults, produced with the simulated
engine (or the fake upstream) behind infertap, is reported, and no other; a healthy run reports
nothing. Timing constants are small and checks compare measured values with each other, so the
whole file runs in seconds.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from proxy.settings import LoopSettings, TimeoutSettings
from proxy.sim import create_sim_app
from proxy.sim.config import SimConfig, sim_config_from_dict
from proxy.tools.doctor import cli as doctor
from proxy.tools.doctor.evidence import Inputs
from proxy.tools.doctor.exposition import Samples, delta, parse
from proxy.tools.doctor.rules import FAULTS, diagnose
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import make_settings, run_proxy, serve_in_thread, wait_until

# A step is ~2 ms; prefill ~0.02 ms a token.
FAST = {
    "prefill_base_ms": 1.0,
    "prefill_ms_per_token": 0.02,
    "decode_step_ms": 2.0,
    "decode_ms_per_running_seq": 0.1,
    "no_kv_cache_ms_per_context_token": 0.0,
    "default_output_tokens": 20,
}


def sim_config(**sections: dict[str, Any]) -> SimConfig:
    data: dict[str, dict[str, Any]] = {"sim": dict(FAST)}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return sim_config_from_dict(data)


@contextmanager
def stack(config: SimConfig, **settings: Any) -> Iterator[tuple[str, str]]:
    """infertap in front of the sim; yields (infertap URL, engine /metrics URL)."""
    with serve_in_thread(create_sim_app(config)) as engine:
        # Warm-up, straight to the engine: the first stream pays one-off lazy imports.
        httpx.post(f"{engine}/v1/chat/completions", json=body("warm", max_tokens=1, stream=True))
        with run_proxy(make_settings(("sim", engine + "/v1"), **settings)) as proxy:
            yield proxy, engine + "/metrics"


def body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], "stream": True, **extra}


Request = tuple[dict[str, Any], dict[str, str]]


def send(proxy: str, requests: list[Request], concurrency: int = 1) -> list[int]:
    """Streams each (body, headers) through infertap to the end; returns the status codes."""

    def one(client: httpx.Client, item: Request) -> int:
        try:
            with client.stream("POST", f"{proxy}/v1/chat/completions", json=item[0], headers=item[1]) as r:
                for _ in r.iter_bytes():
                    pass
                return r.status_code
        except httpx.RemoteProtocolError:
            return -1

    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda item: one(client, item), requests))


def run_doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = doctor.main([*args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def faults(result: dict[str, Any]) -> set[str]:
    return {f["fault"] for f in result["findings"]}


# -- the five faults and a healthy run, in doctor's DEFAULT mode ----------------------------------------
# Only --metrics is given (infertap is not on 8080 here): doctor finds the engine's /metrics itself,
# through infertap's /ui/data. Each fault test asserts that fault and no other.
def default_doctor(capsys: pytest.CaptureFixture[str], proxy: str) -> tuple[int, dict[str, Any]]:
    return run_doctor(capsys, "--metrics", f"{proxy}/metrics")


def test_healthy_run_reports_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with stack(sim_config(), loops=LoopSettings(enabled=True)) as (proxy, engine):
        reqs = [(body(f"question {i}"), {"x-sim-output-tokens": str(10 + 5 * (i % 4))}) for i in range(12)]
        assert send(proxy, reqs, concurrency=3) == [200] * 12
        code, result = default_doctor(capsys, proxy)
    assert result["findings"] == [] and result["needs"] == [] and result["healthy"] is True, result
    assert code == 0
    assert result["source"]["engine_metrics"] == engine  # found through infertap
    assert result["summary"]["requests"] == 12 and result["summary"]["outcomes"] == {"ok": 12}
    assert result["summary"]["degenerate"] == 0 or result["summary"]["degenerate"] is None


def test_kv_cache_off(capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 16's case: `infertap sim --no-kv-cache` with its default timings (scaled down 10x, ratios
    # kept), 20 streams of 16-128 tokens: TPOT rises only ~20% with the context, too little for the
    # length test alone; the engine's cache_config_info says that no KV blocks exist.
    config = sim_config(
        kv_cache={"enable": False},
        sim={"prefill_base_ms": 1.5, "prefill_ms_per_token": 0.005, "decode_step_ms": 2.0,
             "decode_ms_per_running_seq": 0.03, "no_kv_cache_ms_per_context_token": 0.005},
    )  # fmt: skip
    with stack(config) as (proxy, engine):
        reqs = [(body(f"hi {i}"), {"x-sim-output-tokens": str(16 + (112 * i) // 19)}) for i in range(20)]
        assert send(proxy, reqs, concurrency=2) == [200] * 20
        code, result = default_doctor(capsys, proxy)
    assert faults(result) == {"kv_cache"}, result
    assert code == 1
    assert result["findings"][0]["numbers"]["engine_num_gpu_blocks"] == 0
    assert any("kv_cache] enable = true" in c for c in result["findings"][0]["change"])


def test_prefill_queueing(capsys: pytest.CaptureFixture[str]) -> None:
    # One sequence at a time, many long prompts at once: each waits for all before it.
    config = sim_config(batching={"max_num_seqs": 1}, sim={"prefill_ms_per_token": 0.04})
    with stack(config) as (proxy, engine):
        # Distinct prompts: the engine's prefix cache would make repeats nearly free.
        reqs = [(body(f"{i} " + "word " * 1200), {"x-sim-output-tokens": "5"}) for i in range(10)]
        assert send(proxy, reqs, concurrency=10) == [200] * 10
        code, result = default_doctor(capsys, proxy)
    assert faults(result) == {"prefill_queueing"}, result
    assert code == 1
    numbers = result["findings"][0]["numbers"]
    assert numbers["engine_confirmed"] is True and numbers["ttft_p90_s"] > numbers["ttft_p50_s"]
    assert any("max_num_batched_tokens" in c for c in result["findings"][0]["change"])


def test_prompts_over_the_context_limit(capsys: pytest.CaptureFixture[str]) -> None:
    config = sim_config(model={"max_model_len": 256})
    with stack(config) as (proxy, engine):
        reqs = [(body("word " * (600 if i % 2 else 5)), {"x-sim-output-tokens": "8"}) for i in range(12)]
        assert sorted(send(proxy, reqs)) == [200] * 6 + [400] * 6
        code, result = default_doctor(capsys, proxy)
    assert faults(result) == {"context_length"}, result
    assert code == 1 and result["findings"][0]["numbers"]["client_errors"] == 6
    assert any("max_model_len" in c for c in result["findings"][0]["change"])


def test_cut_streams(capsys: pytest.CaptureFixture[str]) -> None:
    upstream = FakeUpstream()
    gap = {"x-fake-events": "8", "x-fake-gap-ms": "5"}
    reqs = [(body("hi"), gap) for _ in range(4)]
    reqs += [(body("hi"), {**gap, "x-fake-cut": "3"}) for _ in range(3)]
    reqs += [(body("hi"), {**gap, "x-fake-hang": "after-first"}) for _ in range(2)]
    with serve_in_thread(upstream) as url:
        settings = make_settings(("fake", url + "/v1"), timeouts=TimeoutSettings(idle=0.3))
        with run_proxy(settings) as proxy:
            send(proxy, reqs, concurrency=3)
            code, result = default_doctor(capsys, proxy)
    assert faults(result) == {"stream_cut"}, result
    numbers = result["findings"][0]["numbers"]
    assert numbers["stream_interrupted"] == 3 and numbers["idle_timeout"] == 2 and code == 1
    assert any("proxy_buffering off" in c for c in result["findings"][0]["change"])


def test_looping_output(capsys: pytest.CaptureFixture[str]) -> None:
    config = sim_config(decode={"temperature": 0.0, "repetition_penalty": 1.0})
    with stack(config, loops=LoopSettings(enabled=True)) as (proxy, engine):
        reqs = [(body(f"tell me {i}"), {"x-sim-output-tokens": "80"}) for i in range(5)]
        assert send(proxy, reqs) == [200] * 5
        code, result = default_doctor(capsys, proxy)
    assert faults(result) == {"looping"}, result
    assert code == 1 and result["findings"][0]["numbers"]["degenerate"] == 5
    assert any("repetition_penalty" in c for c in result["findings"][0]["change"])


def test_thin_evidence_says_what_it_needs_instead_of_all_is_well(capsys: pytest.CaptureFixture[str]) -> None:
    with stack(sim_config()) as (proxy, engine):
        assert send(proxy, [(body("hi"), {"x-sim-output-tokens": "8"})] * 2) == [200] * 2
        code, result = default_doctor(capsys, proxy)
        assert code == 3 and result["findings"] == [] and result["healthy"] is False
        assert any("sample for 30 s more" in n for n in result["needs"]), result
        assert doctor.main(["--metrics", f"{proxy}/metrics", "--no-discover"]) == 3
        out = capsys.readouterr().out
        assert "No problem found" not in out and "Not enough evidence" in out
        assert "point me at the engine's /metrics" in out


def test_a_metrics_page_that_is_not_infertaps_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with stack(sim_config()) as (proxy, engine):
        assert send(proxy, [(body("hi"), {})] * 2) == [200] * 2
        code = doctor.main(["--metrics", engine])
        err = capsys.readouterr().err
        assert code == 2 and "not infertap's" in err and f"--engine-metrics {engine}" in err, err
        code, result = run_doctor(capsys, "--metrics", engine, "--interval", "0.1")
        assert code == 2 and "vLLM names" in result["error"]


# -- other modes: two scrapes, Prometheus ----------------------------------------------------------
def test_interval_mode_sees_the_engine_cache_empty_while_requests_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two scrapes with the engine's gauges polled in between: KV usage stays 0 while requests run."""
    config = sim_config(kv_cache={"enable": False}, sim={"no_kv_cache_ms_per_context_token": 0.25})
    with stack(config) as (proxy, engine):
        reqs = [(body(f"long {i}"), {"x-sim-output-tokens": "60"}) for i in range(2)]
        load = threading.Thread(target=send, args=(proxy, reqs, 2), daemon=True)
        load.start()
        wait_until(lambda: parse(httpx.get(engine).text).total("vllm:num_requests_running") > 0)
        code, result = run_doctor(
            capsys, "--metrics", f"{proxy}/metrics", "--engine-metrics", engine,
            "--interval", "0.5", "--poll", "0.1",
        )  # fmt: skip
        load.join(timeout=30)
    assert faults(result) == {"kv_cache"}, result
    assert result["findings"][0]["numbers"]["engine_kv_cache_usage"] == 0.0 and code == 1
    assert result["source"]["window"].startswith("0.5 s")


class FakePrometheus:
    """Answers the two PromQL shapes doctor sends, `increase(NAME{SEL}[W])` and
    `max_over_time(NAME{SEL}[W])`, from live scrapes of its targets (counters started at 0, so
    the increase over the window is the current value)."""

    QUERY = re.compile(r"^(increase|max_over_time)\(([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}\[(\w+)\]\)$")

    def __init__(self, *targets: str) -> None:
        self.targets = targets
        self.queries: list[str] = []
        self.scraped: list[Samples] | None = None  # the load is over: one scrape serves every query

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        query = urllib.parse.parse_qs(scope["query_string"].decode()).get("query", [""])[0]
        self.queries.append(query)
        m = self.QUERY.match(query)
        if scope["path"] != "/api/v1/query" or m is None:
            status, out = 400, {"status": "error", "error": f"unsupported query {query!r}"}
        else:
            if self.scraped is None:
                async with httpx.AsyncClient() as client:
                    self.scraped = [parse((await client.get(t)).text) for t in self.targets]
            name, result = m.group(2), []
            for samples in self.scraped:
                for labels, v in samples.series(name):
                    result.append({"metric": dict(labels), "value": [0, str(v)]})
            status, out = 200, {"status": "success", "data": {"resultType": "vector", "result": result}}
        data = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": data})


def test_prometheus_mode(capsys: pytest.CaptureFixture[str]) -> None:
    config = sim_config(decode={"temperature": 0.0, "repetition_penalty": 1.0})
    with stack(config, loops=LoopSettings(enabled=True)) as (proxy, engine):
        reqs = [(body(f"tell me {i}"), {"x-sim-output-tokens": "60"}) for i in range(2)]
        assert send(proxy, reqs) == [200] * 2
        prom = FakePrometheus(f"{proxy}/metrics", engine)
        with serve_in_thread(prom) as prom_url:
            code, result = run_doctor(
                capsys, "--prometheus", prom_url, "--window", "5m", "--selector", 'job="infertap"'
            )
    assert faults(result) == {"looping"}, result
    assert code == 1 and result["summary"]["requests"] == 2 and result["summary"]["engine"] is not None
    assert result["source"] == {"metrics": None, "prometheus": prom_url, "engine_metrics": None,
                                "window": "the last 5m"}  # fmt: skip
    assert 'increase(infertap_requests_total{job="infertap"}[5m])' in prom.queries
    assert "max_over_time(vllm:num_requests_waiting{}[5m])" in prom.queries


# -- errors and usage ------------------------------------------------------------------------------
def test_unreachable_source_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        code = doctor.main(["--metrics", f"{url}/metrics"])
        err = capsys.readouterr().err
        assert code == 2 and "cannot reach" in err and url in err and "Traceback" not in err
        code, result = run_doctor(capsys, "--metrics", f"{url}/metrics")
        assert code == 2 and "cannot reach" in result["error"]
        code = doctor.main(["--prometheus", url, "--window", "5m"])
        assert code == 2 and "cannot reach" in capsys.readouterr().err
        code = doctor.main(["--metrics", f"{url}/metrics", "--engine-metrics", f"{url}/metrics"])
        assert code == 2


def test_a_source_that_is_not_metrics_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with serve_in_thread(create_sim_app(sim_config())) as engine:
        code = doctor.main(["--metrics", f"{engine}/v1/models"])
        assert code == 2 and "not a Prometheus /metrics endpoint" in capsys.readouterr().err
        code = doctor.main(["--metrics", f"{engine}/nowhere"])
        assert code == 2 and "HTTP 404" in capsys.readouterr().err
    assert doctor.main(["--prometheus", "http://127.0.0.1:9", "--window", "15 minutes"]) == 2
    assert "--window" in capsys.readouterr().err


def test_help_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--engine-metrics" in out and "Exit status" in out
    assert doctor.main(["--metrics", "http://a/metrics", "--prometheus", "http://b"]) == 2
    assert doctor.main(["--bogus"]) == 2


def test_text_report_names_fault_evidence_and_change(capsys: pytest.CaptureFixture[str]) -> None:
    text = EXPOSITION + 'infertap_requests_total{outcome="stream_interrupted"} 5\n'
    with serve_in_thread(_static(text)) as url:
        code = doctor.main(["--metrics", f"{url}/metrics"])
    out = capsys.readouterr().out
    assert code == 1 and "[stream_cut]" in out and "evidence:" in out and "change:" in out
    assert "5 stream_interrupted" in out


# -- the rules on hand-made expositions ------------------------------------------------------------
EXPOSITION = "".join(f'infertap_requests_total{{outcome="{o}"}} {n}\n' for o, n in (("ok", 95),))


def _static(text: str) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4")]})  # fmt: skip
        await send({"type": "http.response.body", "body": text.encode()})

    return app


def _histogram(name: str, buckets: dict[float, int], total: float) -> str:
    lines, cum = [], 0
    for le, n in sorted(buckets.items()):
        cum += n
        lines.append(f'{name}_bucket{{le="{le}"}} {cum}')
    lines += [f'{name}_bucket{{le="+Inf"}} {cum}', f"{name}_sum {total}", f"{name}_count {cum}"]
    return "\n".join(lines) + "\n"


def test_bunched_chunks_are_reported_as_buffering() -> None:
    # 100 streams of 20 events: most gaps ~0, the time in a few big ones; TPOT normal (20 ms).
    text = (
        EXPOSITION
        + _histogram("infertap_inter_token_latency_seconds", {0.001: 1700, 0.25: 200}, 38.0)
        + _histogram("infertap_time_per_output_token_seconds", {0.025: 95}, 1.9)
    )
    findings = diagnose(Inputs(parse(text)))
    assert [f.fault for f in findings] == ["stream_cut"]
    assert "bunched" in findings[0].evidence[0] and findings[0].numbers["itl_bunched_share"] > 0.8


def test_engine_preemptions_point_at_kv_room() -> None:
    engine = parse(
        'vllm:num_preemptions_total{engine="0"} 30\nvllm:request_success_total{finished_reason="stop"} 100\n'
    )
    findings = diagnose(Inputs(parse(EXPOSITION), engine))
    assert [f.fault for f in findings] == ["context_length"]
    assert findings[0].numbers["engine_preemptions"] == 30


def test_a_few_errors_in_much_traffic_are_not_a_finding() -> None:
    text = 'infertap_requests_total{outcome="ok"} 10000\n'
    text += 'infertap_requests_total{outcome="client_error"} 3\n'
    text += 'infertap_requests_total{outcome="stream_interrupted"} 2\n'
    assert diagnose(Inputs(parse(text))) == []
    assert sorted(FAULTS) == sorted(
        ["kv_cache", "prefill_queueing", "context_length", "stream_cut", "looping"]
    )


def test_exposition_parsing_and_differences() -> None:
    before = parse(
        "# HELP x\n# TYPE vllm_num_requests_waiting gauge\n"
        'vllm_num_requests_waiting{model_name="m"} 3\n'  # OpenMetrics spelling
        'vllm:request_success_total{finished_reason="stop",model_name="a \\"q\\""} 10\n'
        "vllm:request_success_created 1.7e9\n"
        "infertap_requests_total 50\n"
    )
    assert before.gauge("vllm:num_requests_waiting") == 3
    assert before.by("vllm:request_success_total", "model_name") == {'a "q"': 10}
    assert not before.has("vllm:request_success_created")
    after = parse(
        "vllm:num_requests_waiting 1\n"
        'vllm:request_success_total{finished_reason="stop",model_name="a \\"q\\""} 25\n'
        "infertap_requests_total 7\n"  # went down: a restart; 7 happened since
    )
    d = delta(before, after)
    assert d.total("vllm:request_success_total") == 15 and d.total("infertap_requests_total") == 7
    assert d.gauge("vllm:num_requests_waiting") == 1
    h = parse(_histogram("t", {0.1: 50, 0.2: 50}, 15.0)).histogram("t")
    assert h is not None and h.quantile(0.5) == pytest.approx(0.1) and h.quantile(0.75) == pytest.approx(0.15)
    assert h.mean == pytest.approx(0.15) and h.share_at_most(0.1) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        parse("{not metrics}")
