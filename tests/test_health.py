"""/readyz answers from the process's own state; upstream reachability is /status's, checked in
the background."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import make_settings, run_proxy, wait_until

log = logging.getLogger(__name__)


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An upstream that accepts connections (the kernel's backlog does) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_readyz_answers_while_an_upstream_hangs(black_hole: str) -> None:
    settings = make_settings(("hung", black_hole))
    settings.server.upstream_check_timeout = 0.5
    with run_proxy(settings) as proxy, httpx.Client(timeout=10) as c:
        t0 = time.perf_counter()
        r = c.get(f"{proxy}/readyz")
        latency = time.perf_counter() - t0
        log.warning("/readyz answered in %.1f ms while the upstream hangs", latency * 1000)
        assert r.status_code == 200 and r.json() == {"status": "ready"}
        wait_until(lambda: c.get(f"{proxy}/status").json()["upstreams"][0]["last_check"] is not None)
        (row,) = c.get(f"{proxy}/status").json()["upstreams"]
    assert row["reachable"] is False and row["check_error"] == "did not answer within 0.5 s"
    assert row["circuit"]["state"] == "closed" and row["config_warnings"] == []


def test_status_needs_the_metrics_token(black_hole: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRICS_TOKEN", "t0ken")
    settings = make_settings(("hung", black_hole))
    settings.auth.metrics_token_env = "METRICS_TOKEN"
    with run_proxy(settings) as proxy, httpx.Client(timeout=10) as c:
        assert c.get(f"{proxy}/status").status_code == 401
        assert c.get(f"{proxy}/status", headers={"authorization": "Bearer t0ken"}).status_code == 200
        assert c.get(f"{proxy}/readyz").status_code == 200  # probes stay open
