"""A passthrough path stays under the upstream's base path and off the metered routes, however a
server on the way reads it (issue 24, items 4 and 5).

Hypothesis writes paths from a grammar of dots, `;params`, percent-encodings (once to four times),
IIS's `%uXXXX`, NUL, overlong UTF-8, backslashes and route names, and sends them byte for byte.
Each is either refused, with nothing reaching the upstream, or reaches it at a path that, read by the
most lenient server this file can write (`oracle_readings`), stays under the base path; and a
variant of a proxied route is either refused or counted as that route, with its model.
INFERTAP_PATH_EXAMPLES=3000 runs it long (CI: 150 examples, a few seconds).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from urllib.parse import unquote_to_bytes

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, RecordingObserver, make_settings, run_proxy, serve_in_thread
from tests.test_request import raw_request

BASE = ["api", "v1"]  # the upstream's base path: /api/v1
ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"}
EXPENSIVE = {**CHAT, "model": "beta-expensive"}


@pytest.fixture(scope="module")
def based() -> Iterator[tuple[FakeUpstream, RecordingObserver, str]]:
    upstream = FakeUpstream()
    rec = RecordingObserver()
    with serve_in_thread(upstream) as url, run_proxy(make_settings(("based", url + "/api/v1")), rec) as proxy:
        yield upstream, rec, proxy


# -- the regressions: each reached the upstream before ---------------------------------------------

ESCAPES = [
    "/v1/..;/..;/admin",
    "/v1/%2e%2e;/%2e%2e;/admin",
    "/v1/..;x=1/..;x=1/admin",
    "/v1/.;/x",
    "/v1/.%00./x",
    "/v1/models%00/x",
    "/v1/%c0%ae%c0%ae/%c0%ae%c0%ae/admin",
    "/v1/%e0%80%ae%e0%80%ae/admin",
    "/v1/%252525252e%252525252e/admin",  # five decodings
    "/v1/%u002e%u002e/%u002e%u002e/admin",
    "/v1/.../admin",
    "/v1/..%20/admin",
]


def test_paths_a_lenient_server_reads_outside_the_base_are_refused(
    based: tuple[FakeUpstream, RecordingObserver, str],
) -> None:
    upstream, _, proxy = based
    before = len(upstream.requests)
    for path in ESCAPES:
        status, body, _ = raw_request(proxy, "GET", path)
        assert status == 400, (path, status, body)
        assert json.loads(body)["error"]["code"] == "invalid_path", path
    assert [r.raw_path for r in upstream.requests[before:]] == []


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions/", "/v1/chat/completions;x", "/v1//chat/completions", "/v1/Chat/Completions"],
)
def test_a_variant_of_a_proxied_route_is_refused_with_the_route_named(
    based: tuple[FakeUpstream, RecordingObserver, str], path: str
) -> None:
    upstream, _, proxy = based
    before = len(upstream.requests)
    status, body, _ = raw_request(proxy, "POST", path, json.dumps(EXPENSIVE).encode())
    # Before: 200, relayed as route `other` to the default upstream, with no model and no cost.
    assert status == 404, (status, body)
    error = json.loads(body)["error"]
    assert error["code"] == "unknown_route" and "/v1/chat/completions" in error["message"]
    assert len(upstream.requests) == before


def test_ordinary_passthrough_paths_still_pass(based: tuple[FakeUpstream, RecordingObserver, str]) -> None:
    upstream, _, proxy = based
    for path in [
        "/v1/models/llama-3.1..8b",
        "/v1/files/file-abc;v=1",
        "/v1/models/org%2Fname",
        "/v1/caf%C3%A9",
    ]:
        status, _, _ = raw_request(proxy, "GET", path)
        assert status == 200 and upstream.requests[-1].raw_path == b"/api" + path.encode(), path


# -- the class: any path from the grammar ------------------------------------------------------------

PIECES = [
    "/", "\\", ".", "..", "...", "x", "admin", "chat", "completions", "Chat", "embeddings", "v1",
    ";", ";x=1", "%3b", "%2e", "%2E", "%252e", "%25252e", "%2525252e", "%c0%ae", "%e0%80%ae",
    "%u002e", "%00", "%2500", "%2f", "%252f", "%5c", "%255c", "%20", "%c3%a9", "%ff",
]  # fmt: skip


def _lenient_utf8(raw: bytes) -> str:
    """UTF-8 as an old decoder reads it: overlong forms accepted (`c0 ae` is `.`), bad bytes kept."""
    out = []
    i = 0
    while i < len(raw):
        b = raw[i]
        if 0xC0 <= b < 0xE0 and i + 1 < len(raw) and raw[i + 1] & 0xC0 == 0x80:
            out.append(chr(((b & 0x1F) << 6) | (raw[i + 1] & 0x3F)))
            i += 2
        elif (
            0xE0 <= b < 0xF0 and i + 2 < len(raw) and raw[i + 1] & 0xC0 == 0x80 and raw[i + 2] & 0xC0 == 0x80
        ):
            out.append(chr(((b & 0x0F) << 12) | ((raw[i + 1] & 0x3F) << 6) | (raw[i + 2] & 0x3F)))
            i += 3
        else:
            out.append(chr(b))
            i += 1
    return "".join(out)


def oracle_readings(raw: bytes) -> list[list[str]]:
    """The segments of every reading a lenient server might make of `raw`: percent-decoded 0..n
    times (until stable, `%uXXXX` too), overlong UTF-8 accepted, cut at NUL, `\\` as `/` or not,
    `;params` stripped per segment, blanks trimmed."""
    out = []
    current = raw
    for _ in range(64):
        text = _lenient_utf8(current).split("\x00", 1)[0]
        for view in (text, text.replace("\\", "/")):
            out.append([seg.split(";", 1)[0].strip() for seg in view.split("/")])
        decoded = re.sub(
            rb"%[uU]([0-9a-fA-F]{4})", lambda m: chr(int(m[1], 16)).encode("utf-8", "surrogatepass"), current
        )
        decoded = unquote_to_bytes(decoded)
        if decoded == current:
            break
        current = decoded
    return out


def stays_under_base(segs: list[str]) -> bool:
    stack: list[str] = []
    for seg in segs:
        if seg and not seg.strip("."):  # `.`, `..`, and `...` that Windows trims: the worst reading
            if seg != "." and not stack:
                return False
            if seg != ".":
                stack.pop()
        elif seg:
            stack.append(seg)
    return True


@settings(
    max_examples=int(os.environ.get("INFERTAP_PATH_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=10))
@example(pieces=["..;", "/", "..;", "/admin"])
@example(pieces=["chat", "/", "completions", "/"])
@example(pieces=["chat", "/", "completions", ";x=1"])
@example(pieces=["chat", "%2f", "completions"])
def test_any_path_is_refused_or_stays_under_the_base_and_on_its_route(
    based: tuple[FakeUpstream, RecordingObserver, str], pieces: list[str]
) -> None:
    upstream, rec, proxy = based
    path = "/v1/" + "".join(pieces)
    before = len(upstream.requests)
    status, body, headers = raw_request(proxy, "POST", path, json.dumps(EXPENSIVE).encode())
    if status in (400, 404):
        assert json.loads(body)["error"]["code"] in ("invalid_path", "unknown_route", "not_found"), body
        assert len(upstream.requests) == before, f"{path} was refused, yet reached the upstream"
        return
    assert status == 200, (path, status, body)
    received = upstream.requests[-1].raw_path
    assert received.startswith(b"/api/v1/"), received
    readings = oracle_readings(received[len(b"/api/v1") :])
    for segs in readings:
        assert stays_under_base(segs), f"{path} reached the upstream as {received!r}, which can leave /api/v1"
    ex = rec.wait_terminal(headers["x-request-id"])
    for segs in readings:
        canonical = "/v1/" + "/".join(s for s in segs if s).lower()
        if canonical in ROUTES:  # a metered route, however spelled: counted as it, with its model
            assert received == b"/api" + canonical.encode(), received
            assert ex.route != "other" and ex.model == "beta-expensive", (path, ex.route, ex.model)
