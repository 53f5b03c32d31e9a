"""Graceful drain: a real `infertap serve` process gets SIGTERM in the middle of 20 long streams.

With enough drain time every stream completes byte-identical; with too little, each stream still
open ends with an in-band SSE error event (outcome `shutdown`), never a silent cut. In both,
/readyz answers 503 at once. The metrics are read after the process exits from its multiprocess
directory (given explicitly, so it outlives the process).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import serve_in_thread, serve_process, wait_until

STREAMS = 20
EVENTS, GAP_MS = 60, 500  # 30 s per stream
BODY = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
    "stream_options": {"include_usage": True},  # so infertap relays the upstream's bytes unchanged
}
pytestmark = pytest.mark.timeout(180)


def _env(tmp: Path, drain_timeout: float, drain_delay: float) -> dict[str, str]:
    metrics = tmp / "metrics"
    metrics.mkdir()
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "TAOTOKEN_"))},
        "PROMETHEUS_MULTIPROC_DIR": str(metrics),
        "INFERTAP_SERVER__DRAIN_TIMEOUT": str(drain_timeout),
        "INFERTAP_SERVER__DRAIN_DELAY": str(drain_delay),
    }


def _requests_total(metrics_dir: str) -> dict[str, float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, metrics_dir)
    out: dict[str, float] = {}
    for fam in registry.collect():
        for s in fam.samples:
            if s.name == "infertap_requests_total" and s.value:
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + s.value
    return out


class Streams:
    """STREAMS concurrent clients, each keeping what it received and how its stream ended."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.received: dict[str, bytes] = {}
        self.errors: dict[str, str] = {}
        self.threads = [threading.Thread(target=self._one, args=(f"drain-{i}",)) for i in range(STREAMS)]

    def _one(self, rid: str) -> None:
        buf = bytearray()
        headers = {"x-request-id": rid, "x-fake-events": str(EVENTS), "x-fake-gap-ms": str(GAP_MS)}
        try:
            with (
                httpx.Client(timeout=120) as c,
                c.stream("POST", f"{self.base}/v1/chat/completions", json=BODY, headers=headers) as r,
            ):
                for chunk in r.iter_raw():
                    buf.extend(chunk)
        except httpx.HTTPError as e:
            self.errors[rid] = repr(e)
        self.received[rid] = bytes(buf)

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self.threads:
            t.join(timeout=120)


@pytest.fixture
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with serve_in_thread(fake) as url:
        yield fake, url + "/v1"


def _sigterm_and_poll_readyz(base: str, pid: int) -> tuple[int, float]:
    """SIGTERM, then one /readyz poll: its status and how long after the signal it came back."""
    with httpx.Client(timeout=5) as c:
        c.get(f"{base}/healthz")  # an open connection: the poll measures the answer, not a connect
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGTERM)
        status = c.get(f"{base}/readyz").status_code
        return status, time.perf_counter() - t0


def _run(
    tmp: Path, url: str, fake: FakeUpstream, drain_timeout: float, drain_delay: float, workers: int = 1
) -> dict[str, object]:
    env = _env(tmp, drain_timeout, drain_delay)
    log = tmp / "serve.log"
    args = ("--upstream", f"fake={url}", "--forward-header", "x-fake-*", "--workers", str(workers))
    with serve_process(*args, env=env, log=log) as (base, proc):
        assert httpx.get(f"{base}/readyz").status_code == 200
        with Streams(base) as streams:
            started = lambda: len(fake.sent) == STREAMS and all(len(b) > 200 for b in fake.sent.values())  # noqa: E731
            wait_until(started, 60, "all streams to be under way")
            readyz, latency = _sigterm_and_poll_readyz(base, proc.pid)
        proc.wait(timeout=drain_timeout + 30)
    return {
        "readyz": readyz,
        "readyz_latency_ms": round(latency * 1000, 1),
        "streams": streams,
        "outcomes": _requests_total(env["PROMETHEUS_MULTIPROC_DIR"]),
        "log": log.read_text(),
    }


def test_long_drain_lets_every_stream_finish(upstream: tuple[FakeUpstream, str], tmp_path: Path) -> None:
    fake, url = upstream
    r = _run(tmp_path, url, fake, drain_timeout=60, drain_delay=1)
    print(json.dumps({k: v for k, v in r.items() if k in ("readyz", "readyz_latency_ms", "outcomes")}))
    assert r["readyz"] == 503
    streams = r["streams"]
    assert isinstance(streams, Streams)
    assert streams.errors == {}
    assert sorted(streams.received) == sorted(fake.sent)
    for rid, got in streams.received.items():
        assert got == bytes(fake.sent[rid]), rid  # byte-identical, to the end
        assert got.endswith(b"data: [DONE]\n\n")
    assert r["outcomes"] == {"ok": STREAMS}


@pytest.mark.parametrize("workers", [1, 2])
def test_short_drain_ends_open_streams_with_an_error_event(
    upstream: tuple[FakeUpstream, str], tmp_path: Path, workers: int
) -> None:
    fake, url = upstream
    r = _run(tmp_path, url, fake, drain_timeout=2, drain_delay=0.5, workers=workers)
    print(json.dumps({k: v for k, v in r.items() if k in ("readyz", "readyz_latency_ms", "outcomes")}))
    assert r["readyz"] == 503
    streams = r["streams"]
    assert isinstance(streams, Streams)
    assert len(streams.received) == STREAMS
    for rid, got in streams.received.items():
        assert rid not in streams.errors, streams.errors[rid]  # ended by the proxy, not cut
        sent = bytes(fake.sent[rid])
        head, _, last = got.rstrip(b"\n").rpartition(b"\n\n")
        assert sent.startswith(head + b"\n\n"), rid  # everything before the error is the upstream's
        error = json.loads(last.removeprefix(b"data: "))["error"]
        assert error["type"] == "shutdown" and "shutting down" in error["message"]
        assert b"[DONE]" not in got
    assert r["outcomes"] == {"shutdown": STREAMS}
    if workers == 1:  # (with --workers, the workers' log lines do not reach this file: see the report)
        assert str(r["log"]).count('"outcome":"shutdown"') == STREAMS  # the access log agrees
