"""/readyz answers from the process's own state; upstream reachability is /status's, checked in
the background."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator, Mapping

import httpx
import pytest
from pydantic import ValidationError

from proxy.app import create_app
from proxy.core.asgi import Receive, Scope, Send
from proxy.settings import UpstreamSettings
from proxy.tools.fake_upstream import FakeUpstream
from proxy.transport import AiohttpClient
from tests.conftest import make_settings, run_proxy, serve_in_thread, wait_until

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


def test_no_request_infertap_makes_follows_a_redirect() -> None:
    """Regression (issue 24, item 8): GET /v1/models (any client can trigger it) and the background
    check followed a 302 to another host, sent it the upstream's configured headers
    (`X-Custom-Token`) and merged that host's models into the list."""
    seen: list[dict[str, str]] = []

    async def elsewhere(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        body = b'{"object":"list","data":[{"id":"not-yours"}]}'
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    with serve_in_thread(elsewhere) as other:

        async def redirector(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                return
            location = f"{other}/v1/models".encode()
            await send({"type": "http.response.start", "status": 302, "headers": [(b"location", location)]})
            await send({"type": "http.response.body", "body": b""})

        with serve_in_thread(redirector) as url:
            settings = make_settings(("up", url + "/v1"))
            settings.upstreams[0].headers = {"X-Custom-Token": "s3cret-token"}
            settings.server.upstream_check_interval = 0.05
            with run_proxy(settings) as proxy:
                r = httpx.get(proxy + "/v1/models")
                wait_until(
                    lambda: httpx.get(proxy + "/status").json()["upstreams"][0]["last_check"] is not None,
                    what="a background check",
                )
    assert "not-yours" not in r.text
    assert seen == [], seen


def test_url_credentials_and_a_key_variable_are_refused_at_load() -> None:
    """Regression (issue 24, item 17): both passed validation, then every request to that upstream
    was a 500 (the HTTP client refuses to combine them)."""
    with pytest.raises(ValidationError, match="credentials"):
        UpstreamSettings(name="x", base_url="https://user:pw@example.test/v1", api_key_env="SOME_KEY")
    UpstreamSettings(name="x", base_url="https://user:pw@example.test/v1")  # one of them: fine
    UpstreamSettings(name="x", base_url="https://example.test/v1", api_key_env="SOME_KEY")


class _BrokenFor(AiohttpClient):
    """A client whose model-list fetch fails, for one upstream, with what no check expects."""

    async def fetch(self, url: str, headers: Mapping[str, str], timeout: float) -> tuple[int, bytes]:
        if ":9/" in url:
            raise ValueError("unexpected")
        return await super().fetch(url, headers, timeout)


def test_one_upstreams_failed_check_never_stops_the_others(fake: tuple[FakeUpstream, str]) -> None:
    """Regression (issue 24, item 17): an unexpected error in one upstream's check aborted every
    upstream's check (/status showed the others as unknown, a traceback every interval)."""
    _, url = fake
    settings = make_settings(("odd", "http://127.0.0.1:9/v1"), ("good", url))
    settings.server.upstream_check_interval = 0.05
    with serve_in_thread(create_app(settings, client=_BrokenFor)) as proxy:

        def checked() -> bool:
            rows = httpx.get(proxy + "/status").json()["upstreams"]
            return all(row["last_check"] is not None for row in rows)

        wait_until(checked, what="every upstream's check")
        rows = {row["name"]: row for row in httpx.get(proxy + "/status").json()["upstreams"]}
        models = httpx.get(proxy + "/v1/models")
    assert rows["good"]["reachable"] is True
    assert rows["odd"]["reachable"] is False and "unexpectedly" in rows["odd"]["check_error"]
    assert models.status_code == 200 and models.json()["data"]
