"""What a client sends is hostile until checked: paths and headers, end to end through a real infertap."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, make_settings, run_proxy, serve_in_thread

# Each would reach the upstream outside its base path once a client, infertap or the upstream
# normalizes it (on main they all arrived as POST /secret or /admin, with the upstream's key).
ESCAPES = [
    "/v1/../../secret",
    "/v1/..%2F..%2Fsecret",
    "/v1/..%2f..%2fsecret",
    "/v1/%2E%2E/%2E%2E/secret",
    "/v1/%2e%2e/%2e%2e/secret",
    "/v1/.%2E/.%2e/secret",
    "/v1/%2E./%2e./secret",
    "/v1/files/..%2F..%2F..%2Fadmin",
    "/v1/files/../../../admin",
    "/v1/./../secret",
    "/v1/%2E/%2E%2E/secret",
    "/v1/..",
    "/v1/models/..",
    "/v1/models/%2E%2E",
    "/v1/..%5C..%5Csecret",
    "/v1/..\\..\\secret",
    "/v1/%252E%252E/%252E%252E/secret",
    "/v1/%25252e%25252e/secret",
    "/v1/models/..?x=1",
    "/v1/chat/completions/../../../secret",
]


@pytest.fixture
def based() -> Iterator[tuple[FakeUpstream, str]]:
    """An upstream whose base URL has a path, like TaoToken's https://taotoken.net/api."""
    upstream = FakeUpstream()
    with serve_in_thread(upstream) as url, run_proxy(make_settings(("based", url + "/api/v1"))) as proxy:
        yield upstream, proxy


def raw_request(
    base: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, bytes, http.client.HTTPMessage]:
    """Sends `path` byte for byte: http.client neither normalizes nor re-encodes it (httpx does)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.headers
    finally:
        conn.close()


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_paths_that_leave_the_base_path_get_400_and_reach_nothing(
    based: tuple[FakeUpstream, str], method: str
) -> None:
    upstream, proxy = based
    for path in ESCAPES:
        status, body, _ = raw_request(proxy, method, path, json.dumps(CHAT).encode())
        assert status == 400, (path, status, body)
        assert json.loads(body)["error"]["code"] == "invalid_path", path
    assert [r.raw_path for r in upstream.requests] == [], "an escaping path reached the upstream"
    # Ordinary passthrough paths under the base still work, dots inside a segment included.
    status, _, _ = raw_request(proxy, "GET", "/v1/models/llama-3.1..8b")
    assert status == 200 and upstream.requests[-1].raw_path == b"/api/v1/models/llama-3.1..8b"


def test_percent_encoded_slash_in_a_model_id_is_kept(based: tuple[FakeUpstream, str]) -> None:
    upstream, proxy = based
    status, _, _ = raw_request(proxy, "GET", "/v1/models/org%2Fname?x=1")
    assert status == 200
    # One path segment upstream, as the client meant it: not /models/org/name.
    assert upstream.requests[-1].raw_path == b"/api/v1/models/org%2Fname"


def test_hop_by_hop_headers_named_in_connection_stay_here_and_x_forwarded_for_grows(
    based: tuple[FakeUpstream, str],
) -> None:
    upstream, proxy = based
    status, _, _ = raw_request(
        proxy,
        "POST",
        "/v1/chat/completions",
        json.dumps(CHAT).encode(),
        {
            "connection": "keep-alive, X-Fake-Secret-Hop",
            "x-fake-secret-hop": "for the next hop only",
            "x-forwarded-for": "203.0.113.7",
            "x-fake-kept": "1",
        },
    )
    assert status == 200
    seen = upstream.requests[-1].headers
    assert "x-fake-secret-hop" not in seen and seen["x-fake-kept"] == "1"
    assert seen["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
    raw_request(proxy, "POST", "/v1/chat/completions", json.dumps(CHAT).encode())
    assert upstream.requests[-1].headers["x-forwarded-for"] == "127.0.0.1"
