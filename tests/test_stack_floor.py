"""scripts/perf/stack_floor.py: each minimal relay docs/benchmarks.md measures relays what the
upstream sent, streamed and whole, over a kept-alive connection (a relay that dropped or garbled
bytes would make its cheap figures worthless)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

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


def _start(mode: str, upstream_port: int, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    port_file = tmp / f"{mode}.port"
    cmd = [
        sys.executable,
        str(ROOT / "scripts/perf/stack_floor.py"),
        mode,
        str(upstream_port),
        str(port_file),
    ]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text():
            port = int(port_file.read_text())
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                return proc, port
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"{mode} did not start")


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
def test_each_minimal_relay_relays_the_upstream_unchanged(
    mode: str, upstream: Upstream, tmp_path: Path
) -> None:
    proc, port = _start(mode, upstream.port, tmp_path)
    try:
        direct = _answers(upstream.url)
        relayed = _answers(f"http://127.0.0.1:{port}")
    finally:
        proc.kill()
        proc.wait()
    assert relayed == direct
    assert relayed[0].count(b"data: ") == 5 + 3  # role, five tokens, finish, [DONE]
    assert json.loads(relayed[1])["usage"]["completion_tokens"] == 5
