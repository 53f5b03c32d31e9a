"""scripts/perf/stack_floor.py: each minimal relay docs/benchmarks.md measures relays what the
upstream sent, streamed and whole, over a kept-alive connection (a relay that dropped or garbled
bytes would make its cheap figures worthless)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.tools.bench.processes import Upstream

ROOT = Path(__file__).resolve().parents[1]
MODES = ("raw-raw", "raw-aiohttp", "uvicorn-raw", "uvicorn-aiohttp")
BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture(scope="module")
def upstream() -> object:
    up = Upstream(None)
    yield up
    up.close()


def _relay_class() -> Any:
    """scripts/perf/stack_floor_run.py's Relay (the runner's own start-up and readiness wait)."""
    spec = importlib.util.spec_from_file_location("stack_floor_run", ROOT / "scripts/perf/stack_floor_run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Relay


def _answers(base: str) -> list[bytes]:
    out = []
    with httpx.Client(base_url=base, timeout=10) as c:  # one kept-alive connection for all four
        for stream in (True, False, True, False):
            r = c.post(
                "/v1/chat/completions", json={**BODY, "stream": stream}, headers={"x-bench-tokens": "5"}
            )
            assert r.status_code == 200
            out.append(r.content)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_each_minimal_relay_relays_the_upstream_unchanged(mode: str, upstream: Upstream) -> None:
    relay = _relay_class()(mode, upstream.port)
    try:
        direct = _answers(upstream.url)
        relayed = _answers(f"http://127.0.0.1:{relay.port}")
    finally:
        relay.close()
    assert relayed == direct
    assert relayed[0].count(b"data: ") == 5 + 3  # role, five tokens, finish, [DONE]
    assert json.loads(relayed[1])["usage"]["completion_tokens"] == 5
