"""The simulated engine, over real HTTP: a uvicorn server in a thread, the openai SDK and httpx.

Timing checks compare measured values with each other (ratios with wide margins), never with
tight absolute thresholds; the configs use small constants so the whole file runs in seconds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from proxy.sim import SimConfig, SimConfigError, create_sim_app, load_sim_config
from proxy.sim.cli import main as sim_main
from proxy.sim.config import sim_config_from_dict
from proxy.sim.metrics import ITL_BUCKETS, TTFT_BUCKETS

# Small timing constants: a step is ~5 ms, prefill ~0.02 ms a token.
FAST = {
    "prefill_base_ms": 2.0,
    "prefill_ms_per_token": 0.02,
    "decode_step_ms": 5.0,
    "decode_ms_per_running_seq": 0.1,
    "no_kv_cache_ms_per_context_token": 0.005,
    "default_output_tokens": 20,
}


def make_config(**sections: dict[str, Any]) -> SimConfig:
    data: dict[str, dict[str, Any]] = {"sim": dict(FAST)}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return sim_config_from_dict(data)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@contextmanager
def sim_server(config: SimConfig | None = None) -> Iterator[str]:
    """The sim under a real uvicorn on 127.0.0.1:0; yields its OpenAI base URL."""
    app = create_sim_app(config or make_config())
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", timeout_graceful_shutdown=2
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), what="sim start")
    assert server.started
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        base = f"http://127.0.0.1:{port}/v1"
        with httpx.Client() as c:  # warm-up: the first stream pays one-off lazy imports
            c.post(f"{base}/chat/completions", json=chat_body("warm", max_tokens=1, stream=True))
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


Headers = dict[str, str] | None


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics, keyed `name{label="v",...}` (labels sorted, engine/model_name left out)."""
    text = httpx.get(base.removesuffix("/v1") + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name")
            )
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def stream(
    client: httpx.Client, body: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """Stream one chat completion; the events and the client-side time of each content event."""
    t0 = time.perf_counter()
    events: list[Any] = []
    times: list[float] = []
    with client.stream("POST", "/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[6:]
            events.append(data if data == "[DONE]" else orjson.loads(data))
            if (
                data != "[DONE]"
                and events[-1]["choices"]
                and events[-1]["choices"][0]["delta"].get("content")
            ):
                times.append(time.perf_counter() - t0)
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"events": events, "times": times, "ttft": times[0] if times else None, "tpot": tpot}


# -- wire format -----------------------------------------------------------------------------------


def test_stream_wire_format_without_and_with_usage() -> None:
    with sim_server() as base, httpx.Client(base_url=base) as client:
        plain = stream(client, chat_body("hello world"), {"x-sim-output-tokens": "5"})["events"]
        assert plain[-1] == "[DONE]"
        chunks = plain[:-1]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        for c in chunks:
            assert c["object"] == "chat.completion.chunk" and c["model"] == "sim-model"
            assert set(c) == {"id", "object", "created", "model", "choices"}  # no usage unless asked
            assert c["id"] == chunks[0]["id"]
        content = chunks[1:-1]
        assert len(content) == 5
        for c in content:
            (choice,) = c["choices"]
            assert choice["finish_reason"] is None and choice["logprobs"] is None
            assert list(choice["delta"]) == ["content"] and choice["delta"]["content"]
        assert chunks[-1]["choices"][0] == {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": "stop",
        }

        body = chat_body("hello world", max_tokens=3, stream_options={"include_usage": True})
        events = stream(client, body)["events"]
        assert events[-1] == "[DONE]"
        *others, usage_chunk = events[:-1]
        assert all(c["usage"] is None for c in others)
        assert others[-1]["choices"][0]["finish_reason"] == "length"
        assert usage_chunk["choices"] == []
        # "hello world": 2 tokens, + 2 for the one message, + 1 for the assistant turn.
        assert usage_chunk["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},  # a first request: nothing cached yet
            "completion_tokens_details": {"reasoning_tokens": 0},
        }


def test_openai_sdk_chat_completions_embeddings_models() -> None:
    with sim_server() as base, openai.OpenAI(base_url=base, api_key="unused") as client:
        assert [m.id for m in client.models.list()] == ["sim-model"]
        got = client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-sim-output-tokens": "7"},
        )
        chunks = list(got)
        text = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(text) == 7 and chunks[0].model == "sim-model"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7

        whole = client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert whole.choices[0].finish_reason == "length" and whole.usage is not None
        assert whole.usage.completion_tokens == 4
        # The sim's own output re-tokenizes to what it was generated as.
        reply = whole.choices[0].message.content or ""
        again = client.completions.create(model="sim-model", prompt=reply, max_tokens=1)
        assert again.usage is not None and again.usage.prompt_tokens == 4 + 1  # + BOS

        done = client.completions.create(model="sim-model", prompt="once upon", stream=True, max_tokens=6)
        pieces = list(done)
        assert "".join(p.choices[0].text for p in pieces).count(" ") >= 4
        assert pieces[-1].choices[0].finish_reason == "length"

        # the SDK asks for base64
        emb = client.embeddings.create(model="sim-model", input=["alpha beta", "gamma"])
        assert [len(d.embedding) for d in emb.data] == [384, 384]
        assert emb.usage.prompt_tokens == 3
        emb2 = client.embeddings.create(model="sim-model", input="alpha beta", encoding_format="float")
        assert emb2.data[0].embedding == pytest.approx(emb.data[0].embedding, rel=1e-6)


def test_bad_requests() -> None:
    with sim_server() as base, httpx.Client(base_url=base) as client:
        r = client.post(
            "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = client.post("/chat/completions", json=chat_body("x", temperature=3))
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
        r = client.post("/chat/completions", json=chat_body("x", n=2))
        assert r.status_code == 400
        r = client.post("/chat/completions", json=chat_body("x"), headers={"x-sim-output-tokens": "lots"})
        assert r.status_code == 400 and "x-sim-output-tokens" in r.json()["error"]["message"]
        assert client.get("/nowhere").status_code == 404
        assert client.get(base.removesuffix("/v1") + "/health").status_code == 200


def test_over_long_prompt_gets_vllms_400() -> None:
    config = make_config(model={"max_model_len": 256})
    with sim_server(config) as base, httpx.Client(base_url=base) as client:
        long = " ".join(["word"] * 300)
        r = client.post("/chat/completions", json=chat_body(long, max_tokens=10))
        assert r.status_code == 400
        assert r.json() == {
            "object": "error",
            "message": "This model's maximum context length is 256 tokens. However, you requested 313 "
            "tokens (303 in the messages, 10 in the completion). Please reduce the length of the messages "
            "or completion.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        # Fits alone, but not with the completion asked for.
        r = client.post("/chat/completions", json=chat_body(" ".join(["word"] * 200), max_tokens=100))
        assert r.status_code == 400 and "(203 in the messages, 100 in the completion)" in r.json()["message"]
        with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as sdk:
            with pytest.raises(openai.BadRequestError) as err:
                sdk.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": long}])
        assert err.value.status_code == 400 and "maximum context length is 256" in str(err.value)


# -- timing model ----------------------------------------------------------------------------------


def test_ttft_rises_with_prompt_length() -> None:
    with sim_server() as base, httpx.Client(base_url=base) as client:
        hdr = {"x-sim-output-tokens": "2"}
        short = min(stream(client, chat_body(f"short question {i}"), hdr)["ttft"] for i in range(3))
        # A distinct first word each time, so the prefix cache cannot serve the long prompt.
        long = min(
            stream(client, chat_body(f"{i} " + " ".join(["word"] * 6000)), hdr)["ttft"] for i in range(3)
        )
        assert long > 3 * short


def test_fixed_timing_headers_override_the_model() -> None:
    with sim_server(make_config(batching={"max_num_seqs": 1})) as base, httpx.Client(base_url=base) as client:
        slow = stream(
            client,
            chat_body("x"),
            {"x-sim-ttft-ms": "150", "x-sim-tpot-ms": "20", "x-sim-output-tokens": "6"},
        )
        fast = stream(
            client, chat_body("x"), {"x-sim-ttft-ms": "1", "x-sim-tpot-ms": "2", "x-sim-output-tokens": "6"}
        )
        assert len(slow["times"]) == len(fast["times"]) == 6
        assert slow["ttft"] >= 0.14 and slow["ttft"] > 5 * fast["ttft"]  # timers never fire early
        assert slow["tpot"] > 4 * fast["tpot"]
        m = metrics(base)
        assert m["vllm:num_requests_running"] == 0


async def _concurrent(
    base: str, n: int, body: dict[str, Any], headers: dict[str, str]
) -> list[dict[str, Any]]:
    async def one(client: httpx.AsyncClient) -> dict[str, Any]:
        t0 = time.perf_counter()
        first = last = None
        count = 0
        async with client.stream("POST", "/chat/completions", json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                    last = time.perf_counter() - t0
                    first = first or last
                    count += 1
        tpot = (last - first) / (count - 1) if first is not None and last is not None and count > 1 else None
        return {"ttft": first, "tokens": count, "tpot": tpot}

    limits = httpx.Limits(max_connections=n + 10)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(n))))


def test_ttft_rises_with_load_beyond_max_num_seqs() -> None:
    with sim_server(make_config(batching={"max_num_seqs": 2})) as base:
        body = chat_body("what is the KV cache", stream=True)
        results = asyncio.run(_concurrent(base, 6, body, {"x-sim-output-tokens": "20"}))
        ttfts = sorted(r["ttft"] for r in results)
        assert all(r["tokens"] == 20 for r in results)
        first, last = sum(ttfts[:2]) / 2, sum(ttfts[-2:]) / 2
        assert last > 3 * first  # the last two waited for two whole batches
        m = metrics(base)
        assert m["vllm:request_queue_time_seconds_sum"] > 0
        assert m["vllm:num_requests_waiting"] == 0 and m["vllm:num_requests_running"] == 0


def test_tpot_rises_with_the_number_of_running_sequences() -> None:
    # A decode step costs 5 ms + 5 ms per running sequence: ~10 ms alone, ~85 ms among 16.
    config = make_config(sim={"decode_step_ms": 5.0, "decode_ms_per_running_seq": 5.0})
    body = chat_body("decode with company", stream=True)
    with sim_server(config) as base:
        (alone,) = asyncio.run(_concurrent(base, 1, body, {"x-sim-output-tokens": "20"}))
        crowd = asyncio.run(_concurrent(base, 16, body, {"x-sim-output-tokens": "20"}))
    assert all(r["tokens"] == 20 for r in (alone, *crowd))
    assert statistics.median(r["tpot"] for r in crowd) > 3 * alone["tpot"]


def _tpots(base: str) -> tuple[float, float]:
    with httpx.Client(base_url=base, timeout=30) as client:
        hdr = {"x-sim-output-tokens": "20"}
        short = stream(client, chat_body("short prompt"), hdr)["tpot"]
        long = stream(client, chat_body(" ".join(["word"] * 4000)), hdr)["tpot"]
        return short, long


def test_tpot_rises_with_context_only_without_kv_cache() -> None:
    with sim_server(make_config()) as base:
        on_short, on_long = _tpots(base)
    with sim_server(make_config(kv_cache={"enable": False})) as base:
        off_short, off_long = _tpots(base)
    assert on_long < 1.5 * on_short  # with the cache, a step does not recompute the history
    assert off_long > 2 * off_short  # without it, every step re-reads the 4000-token context
    assert off_long > 2 * on_long


def test_preemptions_when_kv_blocks_run_out() -> None:
    # 16 blocks of 16 tokens: four sequences that each grow to ~8 blocks cannot all stay.
    small = make_config(kv_cache={"num_gpu_blocks": 16}, model={"max_model_len": 256})
    body = chat_body(" ".join(["word"] * 50), stream=True, stream_options={"include_usage": True})
    with sim_server(small) as base:
        results = asyncio.run(_concurrent(base, 4, body, {"x-sim-output-tokens": "60"}))
        assert [r["tokens"] for r in results] == [60] * 4  # nothing lost or repeated by recompute
        m = metrics(base)
        assert m["vllm:num_preemptions_total"] > 0
        assert m["vllm:kv_cache_usage_perc"] == 0
    roomy = make_config(model={"max_model_len": 256})
    with sim_server(roomy) as base:
        asyncio.run(_concurrent(base, 4, body, {"x-sim-output-tokens": "60"}))
        assert metrics(base)["vllm:num_preemptions_total"] == 0


def test_prefix_cache_hits_on_a_repeated_prompt() -> None:
    with sim_server() as base, httpx.Client(base_url=base) as client:
        prompt = chat_body(" ".join(["shared"] * 200), max_tokens=2)
        client.post("/chat/completions", json=prompt)
        before = metrics(base)
        client.post("/chat/completions", json=prompt)
        after = metrics(base)
        queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
        hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        assert queries == 203 and hits == 192  # whole 16-token blocks, leaving the last token to compute


# -- output ----------------------------------------------------------------------------------------


def _text(client: httpx.Client, **params: Any) -> str:
    body = chat_body("tell me a story", max_tokens=60, **params)
    r = client.post("/chat/completions", json=body, headers={"x-sim-output-tokens": "60"})
    return str(r.json()["choices"][0]["message"]["content"])


QUICK = make_config(sim={"decode_step_ms": 0.5})  # for tests of the text, not of timing


def test_greedy_without_repetition_penalty_loops() -> None:
    with sim_server(QUICK) as base, httpx.Client(base_url=base) as client:
        looping = _text(client, temperature=0, repetition_penalty=1.0).split()
        assert len(looping) >= 40 and len(set(looping)) <= 6
        varied = _text(client, temperature=0.7, repetition_penalty=1.0).split()
        assert len(set(varied)) > 20
        fixed = _text(client, temperature=0, repetition_penalty=1.1).split()
        assert len(set(fixed)) > 20
        # Greedy decoding is deterministic, and so is a seeded request.
        assert _text(client, temperature=0) == _text(client, temperature=0)
        assert _text(client, seed=5) == _text(client, seed=5) != _text(client, seed=6)


def test_a_run_is_deterministic_under_the_engine_seed() -> None:
    def run(seed: int) -> list[str]:
        config = make_config(sim={"decode_step_ms": 0.5, "seed": seed})
        with sim_server(config) as base, httpx.Client(base_url=base) as client:
            return [_text(client, temperature=0.7) for _ in range(3)]  # unseeded, sampled requests

    first = run(1)
    assert len(set(first)) == 3  # each request of a run differs ...
    assert run(1) == first  # ... but the same run under the same seed gives the same texts
    assert run(2) != first


def test_stop_string_ends_the_answer() -> None:
    with sim_server(QUICK) as base, httpx.Client(base_url=base) as client:
        words = _text(client, temperature=0).split()
        stop_word = next(w for w in words[3:] if w not in words[:3] and "." not in w)
        body = chat_body("tell me a story", temperature=0, max_tokens=60, stop=[stop_word])
        r = client.post("/chat/completions", json=body, headers={"x-sim-output-tokens": "60"})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert stop_word not in choice["message"]["content"]
        assert choice["message"]["content"].split() == words[: words.index(stop_word)]


# -- disconnects -----------------------------------------------------------------------------------


def test_client_disconnect_frees_the_slot_and_the_queue() -> None:
    with sim_server(make_config(batching={"max_num_seqs": 1})) as base, httpx.Client(base_url=base) as client:
        long = {"x-sim-output-tokens": "1000"}
        body = chat_body("go on", stream=True, max_tokens=1000)
        with client.stream("POST", "/chat/completions", json=body, headers=long) as running:
            lines = running.iter_lines()
            assert '"role":"assistant"' in next(lines)
            with client.stream("POST", "/chat/completions", json=body, headers=long) as queued:
                # Keep the line iterator referenced: a discarded one closes the connection.
                queued_lines = queued.iter_lines()
                assert '"role":"assistant"' in next(queued_lines)  # the role chunk comes at once
                wait_until(lambda: metrics(base)["vllm:num_requests_waiting"] == 1, what="queued")
            wait_until(lambda: metrics(base)["vllm:num_requests_waiting"] == 0, what="queue freed")
            assert '"content":"' in next(x for x in lines if x)
        wait_until(lambda: metrics(base)["vllm:num_requests_running"] == 0, what="slot freed")
        # The one slot is free again: a new request starts at once.
        assert stream(client, chat_body("next"), {"x-sim-output-tokens": "2"})["ttft"] is not None
        m = metrics(base)
        assert m['vllm:request_success_total{finished_reason="abort"}'] == 2

        # A non-streaming request notices the disconnect too.
        with pytest.raises(httpx.ReadTimeout):
            client.post("/chat/completions", json=chat_body("x", max_tokens=1000), headers=long, timeout=0.3)
        wait_until(lambda: metrics(base)["vllm:num_requests_running"] == 0, what="non-stream slot freed")


# -- metrics ---------------------------------------------------------------------------------------

VLLM_NAMES = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
]


def test_metrics_have_vllms_names_buckets_and_exact_counts() -> None:
    with sim_server() as base, httpx.Client(base_url=base) as client:
        before = metrics(base)
        for _ in range(3):
            stream(client, chat_body("count me"), {"x-sim-output-tokens": "6"})
        text = httpx.get(base.removesuffix("/v1") + "/metrics").text
        after = metrics(base)

    for name in VLLM_NAMES:
        assert f"\n{name}" in text or f"\n{name}_bucket" in text, name
    assert 'engine="0"' in text and 'model_name="sim-model"' in text

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 5
    assert delta("vllm:generation_tokens_total") == 18
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta('vllm:request_success_total{finished_reason="stop"}') == 3

    def bounds(name: str) -> list[float]:
        return [float(k.split('le="')[1].rstrip('"}')) for k in after if k.startswith(name + "_bucket")]

    assert bounds("vllm:time_to_first_token_seconds")[:-1] == list(TTFT_BUCKETS)
    assert bounds("vllm:inter_token_latency_seconds")[:-1] == list(ITL_BUCKETS)


def test_promtool_check_metrics() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is not on PATH (apt-get install prometheus)")
        pytest.skip("promtool is not on PATH")
    with sim_server() as base, httpx.Client(base_url=base) as client:
        stream(client, chat_body("lint me"), {"x-sim-output-tokens": "3"})
        exposition = httpx.get(base.removesuffix("/v1") + "/metrics").content
    raw = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=30)
    # Exit 1 would be a parse error, 3 is lint findings. The linter objects to exactly two things,
    # both vLLM's own naming that the sim keeps so vLLM dashboards work unchanged: the ':' in every
    # name (reserved for recording rules) and vllm:iteration_tokens_total, a histogram ending in _total.
    assert raw.returncode == 3, raw.stderr
    findings = [ln.split(" ", 1) for ln in (raw.stdout + raw.stderr).decode().splitlines() if ln.strip()]
    families = {ln.split(b" ")[2].decode() for ln in exposition.splitlines() if ln.startswith(b"# TYPE ")}
    colon = {name for name, text in findings if text == "metric names should not contain ':'"}
    assert {f for f in families if f.startswith("vllm:")} <= colon, "promtool did not lint every family"
    others = [(n, t) for n, t in findings if t != "metric names should not contain ':'"]
    assert others == [("vllm:iteration_tokens_total", 'non-counter metrics should not have "_total" suffix')]
    # The same exposition with those two names spelled the Prometheus way passes outright: every
    # help text, unit, type and suffix is right.
    renamed = exposition.replace(b"vllm:iteration_tokens_total", b"vllm_iteration_tokens")
    clean = subprocess.run(
        [promtool, "check", "metrics"],
        input=renamed.replace(b"vllm:", b"vllm_"),
        capture_output=True,
        timeout=30,
    )
    assert clean.returncode == 0 and not clean.stdout + clean.stderr, clean.stderr


# -- throughput ------------------------------------------------------------------------------------


async def _raw_stream_tokens(port: int, body: dict[str, Any], headers: dict[str, str]) -> int:
    # A bare HTTP/1.1 client: httpx's connection pool costs O(n^2) at hundreds of connections,
    # which would measure the client rather than the sim.
    payload = orjson.dumps(body)
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        "host: 127.0.0.1",
        "content-type: application/json",
        f"content-length: {len(payload)}",
        "connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write("\r\n".join(head).encode() + b"\r\n\r\n" + payload)
        data = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    assert data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in data
    return data.count(b'"content":"') - data.count(b'"content":""')


def test_hundreds_of_concurrent_streams_share_one_scheduler_step() -> None:
    async def run(port: int) -> list[int]:
        body = chat_body("hi", stream=True)
        hdr = {"x-sim-output-tokens": "10"}
        return list(await asyncio.gather(*(_raw_stream_tokens(port, body, hdr) for _ in range(300))))

    with sim_server(make_config(batching={"max_num_seqs": 512})) as base:
        before = metrics(base)
        assert asyncio.run(run(int(base.split(":")[-1].split("/")[0]))) == [10] * 300
        m = metrics(base)
    # One engine step advances every running stream: 3000 tokens take a few dozen steps, not 3000.
    # (Counted, not timed: with client and server sharing this process, the pace is the CPU's.)
    steps = m["vllm:iteration_tokens_total_count"] - before["vllm:iteration_tokens_total_count"]
    assert steps < 3000 / 10


def _is_token(line: str) -> bool:
    return '"content":"' in line and '"content":""' not in line


async def _tokens_during_a_long_prefill(base: str) -> int:
    """Tokens a running stream receives between a 6000-token prompt's arrival and its first token."""
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        long_started = asyncio.Event()

        async def long_prompt() -> None:
            body = chat_body(" ".join(["word"] * 6000), stream=True, max_tokens=2)
            async with client.stream("POST", "/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if _is_token(line):
                        long_started.set()

        seen = during = 0
        task: asyncio.Task[None] | None = None
        body = chat_body("keep talking", stream=True)
        async with client.stream(
            "POST", "/chat/completions", json=body, headers={"x-sim-output-tokens": "80"}
        ) as r:
            async for line in r.aiter_lines():
                if not _is_token(line):
                    continue
                seen += 1
                if seen == 10:
                    task = asyncio.create_task(long_prompt())
                elif task is not None and not long_started.is_set():
                    during += 1
        assert task is not None
        await task
    return during


def test_chunked_prefill_keeps_running_decodes_going() -> None:
    # In 512-token chunks the 6000-token prompt shares a dozen steps with the running stream, which
    # gets a token in each; unchunked it is one ~300 ms step, during which that stream waits.
    # (Counted in tokens and engine steps, not timed: the machine's speed cannot change it.)
    chunks = make_config(prefill={"chunked_prefill": True, "max_prefill_tokens": 512})
    with sim_server(chunks) as base:
        chunked = asyncio.run(_tokens_during_a_long_prefill(base))
        steps_chunked = metrics(base)
    with sim_server(make_config(prefill={"chunked_prefill": False})) as base:
        whole = asyncio.run(_tokens_during_a_long_prefill(base))
        steps_whole = metrics(base)
    # ~13 against ~2; a request that reaches the engine a step or two late adds as many to both.
    assert chunked - whole >= 8, (chunked, whole)

    def steps(m: dict[str, float], le: str = "+Inf") -> float:
        return m[f'vllm:iteration_tokens_total_bucket{{le="{le}"}}']

    # No chunked step computed more than a chunk plus the decodes; the unchunked engine ran one
    # step of the whole prompt.
    assert steps(steps_chunked, "1024.0") == steps(steps_chunked)
    assert steps(steps_whole, "4096.0") == steps(steps_whole) - 1


def test_static_batching_makes_a_newcomer_wait_for_the_whole_batch() -> None:
    async def newcomer_ttft(base: str) -> float:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            body = chat_body("a long answer", stream=True)
            async with client.stream(
                "POST", "/chat/completions", json=body, headers={"x-sim-output-tokens": "60"}
            ) as r:
                lines = r.aiter_lines()  # referenced: a dropped iterator would close the stream
                async for line in lines:
                    if '"content":"' in line and '"content":""' not in line:
                        break  # the first is decoding: now a newcomer arrives
                t0 = time.perf_counter()
                async with client.stream("POST", "/chat/completions", json=chat_body("hi", stream=True)) as n:
                    async for line in n.aiter_lines():
                        if '"content":"' in line and '"content":""' not in line:
                            return time.perf_counter() - t0
        raise AssertionError("no token")

    with sim_server(make_config()) as base:
        continuous = asyncio.run(newcomer_ttft(base))
    with sim_server(make_config(batching={"enable_continuous_batching": False})) as base:
        static = asyncio.run(newcomer_ttft(base))
    assert static > 3 * continuous


# -- config and command line -----------------------------------------------------------------------

SEED_CONFIG = """
[server]
host = "0.0.0.0"
port = 8000
api_base = "https://taotoken.net/api"
api_key_env = "TAOTOKEN_API_KEY"
[model]
name = "your-model-name"
dtype = "bfloat16"
max_model_len = 8192
gpu_memory_utilization = 0.90
[kv_cache]
enable = true
block_size = 16
num_gpu_blocks = 2048
swap_space_gb = 8
cache_dtype = "auto"
[batching]
enable_continuous_batching = true
max_num_seqs = 64
max_num_batched_tokens = 4096
[prefill]
chunked_prefill = true
max_prefill_tokens = 2048
[decode]
temperature = 0.7
top_p = 0.9
top_k = 50
repetition_penalty = 1.05
max_tokens = 1024
"""


def test_config_loads_the_seed_file_and_names_bad_fields(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(SEED_CONFIG)
    config = load_sim_config(path)
    assert config.model.name == "your-model-name" and config.kv_cache.num_gpu_blocks == 2048
    assert load_sim_config(None) == SimConfig()

    path.write_text(SEED_CONFIG + "\n[sim]\ndecode_step_ms = 7\nwarp_speed = 9\n")
    with pytest.raises(SimConfigError, match=r"sim\.warp_speed: unknown key"):
        load_sim_config(path)
    path.write_text(SEED_CONFIG.replace("block_size = 16", "block_size = 0"))
    with pytest.raises(SimConfigError, match=r"kv_cache\.block_size"):
        load_sim_config(path)
    path.write_text(SEED_CONFIG.replace("num_gpu_blocks = 2048", "num_gpu_blocks = 8"))
    with pytest.raises(SimConfigError, match=r"kv_cache\.num_gpu_blocks"):
        load_sim_config(path)
    with pytest.raises(SimConfigError, match="cannot read"):
        load_sim_config(tmp_path / "missing.toml")


def test_cli_help_and_bad_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as done:
        sim_main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "infertap sim" in out and "--no-kv-cache" in out and "examples:" in out
    bad = tmp_path / "bad.toml"
    bad.write_text("[kv_cache]\nenable = 'maybe'\n")
    assert sim_main(["--config", str(bad)]) == 2
    assert "kv_cache.enable" in capsys.readouterr().err


def test_cli_prints_the_ready_line_with_the_real_port() -> None:
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "proxy", "sim", "--port", "0", "--tpot-ms", "1", "--output-tokens", "3"]
    with subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            line = child.stdout.readline()
            prefix = "infertap-sim listening on http://127.0.0.1:"
            assert line.startswith(prefix) and line.endswith("/v1\n"), line
            port = int(line[len(prefix) : -len("/v1\n")])
            assert port > 0
            body = {"model": "sim-model", "prompt": "x"}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
            assert r.json()["usage"]["completion_tokens"] == 3
        finally:
            child.terminate()
            child.wait(timeout=10)


def test_slowdown_multiplies_every_step_cost_and_is_refused_when_not_positive() -> None:
    """One replica of a simulated fleet on a slower GPU (the bench's skew workload): `--slowdown X`
    scales prefill and decode alike, and the fixed timings where set, nothing else."""
    from proxy.sim.cli import build_parser, resolve_config
    from proxy.sim.config import STEP_COSTS

    base = resolve_config(build_parser().parse_args(["--tpot-ms", "4"]))
    slow = resolve_config(build_parser().parse_args(["--tpot-ms", "4", "--slowdown", "2.5"]))
    for key in STEP_COSTS:
        assert getattr(slow.sim, key) == pytest.approx(2.5 * getattr(base.sim, key)), key
    assert slow.sim.fixed_tpot_ms == 10.0 and slow.sim.fixed_ttft_ms is None
    assert slow.kv_cache == base.kv_cache and slow.batching == base.batching
    with pytest.raises(SimConfigError, match="slowdown"):
        resolve_config(build_parser().parse_args(["--slowdown", "0"]))
    assert sim_main(["--slowdown", "-1"]) == 2
