"""SSE as the specification and real upstreams write it (issue 24, items 12-15): the three line
endings, events too large to hold, floods before the first token, compressed streams, and garbage.

The class of bugs is "an upstream byte stream the scanner frames wrongly or holds forever", so the
tests are randomized: hypothesis draws events, line endings and read boundaries (against the
scanner), and upstream byte streams with garbage injected at random points (through a real
infertap in front of a raw upstream that may keep its connection open).

INFERTAP_SSE_EXAMPLES=2000 runs them long (CI: a few seconds).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.core.sse import MAX_EVENT_BYTES, MAX_HELD_BYTES, SSEScanner
from tests.conftest import RecordingObserver, make_settings, run_proxy
from tests.raw_upstream import raw_upstream
from tests.sse_read import sse_events

EXAMPLES = int(os.environ.get("INFERTAP_SSE_EXAMPLES", "25"))
LONG = settings(max_examples=EXAMPLES * 4, deadline=None)
E2E = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENDINGS = (b"\n", b"\r\n", b"\r")
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


def _delta(text: str) -> bytes:
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}}],
    }
    return json.dumps(obj, separators=(",", ":")).encode()


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, int, list[int]]:
    """(a well-formed stream, its output events, read boundaries): each line of each event ends
    with any of the three line endings, comments and multi-line data included."""
    mixed = draw(st.booleans())
    style = draw(st.sampled_from(ENDINGS))

    prev = [b""]

    def eol() -> bytes:
        end = draw(st.sampled_from(ENDINGS)) if mixed else style
        if prev[0] == b"\r" and end == b"\n":
            end = b"\r\n"  # a CR then an LF is one CRLF, not two line endings
        prev[0] = end
        return end

    events: list[bytes] = []
    outputs = 0
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["delta", "delta", "comment", "role", "big"]))
        if kind == "comment":
            lines = [b": keep-alive"]
        elif kind == "role":
            lines = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}']
        else:
            size = draw(st.integers(1, 5000 if kind == "big" else 20))
            lines = [b"data: " + _delta("x" * size)]
            outputs += 1
        if draw(st.booleans()):
            lines.insert(0, b"id: " + str(len(events)).encode())
        events.append(b"".join(line + eol() for line in lines) + eol())
        prev[0] = b""
    last = eol()
    # CRLF then a lone CR at the very end is taken as a CRLF cut before its LF (infertap waits for it)
    events.append(b"data: [DONE]" + last + (b"\n" if last == b"\r\n" else eol()))
    body = b"".join(events)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=20)))
    return body, outputs, cuts


def _feed(scanner: SSEScanner, body: bytes, cuts: list[int]) -> tuple[list[bytes], int]:
    out, outputs, pos = [], 0, 0
    for cut in [*cuts, len(body)]:
        data, n = scanner.feed(body[pos:cut])
        out.append(data)
        outputs += n
        pos = cut
    return out, outputs


@LONG
@given(stream=streams())
@example(stream=(b"data: " + _delta("hi") + b"\r\r" + b"data: [DONE]\r\r", 1, []))  # the CR-only
@example(
    stream=(b"data: " + _delta("hi") + b"\r\n\r" + b"\ndata: [DONE]\r\n\r\n", 1, [len(_delta("hi")) + 9])
)
def test_every_line_ending_and_split_frames_the_upstreams_events(
    stream: tuple[bytes, int, list[int]],
) -> None:
    """Item 12: the client gets exactly the upstream's bytes, each output event counted once, and
    the stream is seen to end with [DONE] (before: a CR-only stream was held whole, then flagged)."""
    body, outputs, cuts = stream
    scanner = SSEScanner()
    parts, counted = _feed(scanner, body, cuts)
    out, rest = b"".join(parts), scanner.flush()
    # Only a lone LF may stay behind: the end of a CRLF whose CR closed the last event, read apart.
    assert out + rest == body and rest in (b"", b"\n"), (out, rest)
    assert rest == b"" or out.endswith(b"\r")
    assert counted == outputs
    assert scanner.facts.done


def test_an_event_that_never_ends_is_capped() -> None:
    """Items 12 and 13: an incomplete event past MAX_EVENT_BYTES (a huge line, or a stream with no
    blank line at all) ends the stream instead of being held whole."""
    scanner = SSEScanner()
    scanner.feed(b"data: " + _delta("a") + b"\n\n")
    line = b"data: " + _delta("x") + b"\n"
    with pytest.raises(Exception, match="without the blank line that ends an event"):
        for _ in range(MAX_EVENT_BYTES // len(line) + 2):
            scanner.feed(line)
    assert len(scanner.flush()) <= MAX_EVENT_BYTES


# -- through a real infertap, in front of a raw upstream ------------------------------------------


@contextmanager
def scripted_upstream(bodies: dict[str, bytes]) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A raw upstream answering `bodies[x-test-case]` byte for byte; with `x-test-hold`, it then keeps the
    connection open until infertap closes it (only infertap's idle timeout can end the stream)."""
    seen: list[dict[str, str]] = []

    def answer(path: str, headers: dict[str, str]) -> bytes:
        case = headers.get("x-test-case")
        if case is None:  # infertap's background model-list checks
            return b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        seen.append(headers)
        return bodies[case]

    def hold(headers: dict[str, str]) -> bool:
        return "x-test-hold" in headers and "x-test-case" in headers

    with raw_upstream(answer, hold=hold) as url:
        yield url, seen


BODIES: dict[str, bytes] = {}


@pytest.fixture(scope="module")
def proxy() -> Iterator[tuple[str, list[dict[str, str]], RecordingObserver]]:
    rec = RecordingObserver()
    with scripted_upstream(BODIES) as (url, seen):
        s = make_settings(("raw", url))
        s.retry.max_attempts = 1
        s.circuit.min_calls = 1_000_000  # every request here fails on purpose
        s.timeouts.idle = 1
        s.timeouts.ttft = 5
        with run_proxy(s, rec) as base:
            yield base, seen, rec


def _post(base: str, case: str, body: bytes, hold: bool = False) -> httpx.Response:
    BODIES[case] = body
    headers = {"x-test-case": case, **({"x-test-hold": "1"} if hold else {})}
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    # The client's own timeout is a safety net far above infertap's idle timeout (1 s): a stream
    # that only ends by it is the bug.
    r = httpx.post(base + "/v1/chat/completions", json=req, headers=headers, timeout=60)
    return r


def _framed(body: bytes, framing: str) -> bytes:
    if framing == "chunked":
        parts = [body[i : i + 97] for i in range(0, len(body), 97)]
        chunks = b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in parts)
        return HEAD + b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    if framing == "length":
        return HEAD + b"content-length: %d\r\n\r\n" % len(body) + body
    return HEAD + b"connection: close\r\n\r\n" + body


def test_a_cr_only_stream_is_relayed_whole(proxy: tuple[str, list[dict[str, str]], Any]) -> None:
    """Item 12 end to end (before: the whole stream came at the end, then an error event)."""
    base, _, _ = proxy
    stream = b"data: " + _delta("hi") + b"\r\r" + b"data: " + _delta(" there") + b"\r\rdata: [DONE]\r\r"
    r = _post(base, "cr", _framed(stream, "close"))
    assert r.status_code == 200 and r.content == stream


def test_a_huge_event_ends_the_stream_in_band(proxy: tuple[str, list[dict[str, str]], Any]) -> None:
    """Item 13: a 10 MB line after the first token ends the stream with an in-band error (before: it
    was held whole, and the stream ended "without [DONE]")."""
    base, _, _ = proxy
    first = b"data: " + _delta("hi") + b"\n\n"
    r = _post(base, "huge", _framed(first + b"data: " + b"x" * (10 << 20) + b"\n\ndata: [DONE]\n\n", "close"))
    assert r.status_code == 200 and r.content.startswith(first)
    error = json.loads(sse_events(r.content)[-1])["error"]
    assert f"more than {MAX_EVENT_BYTES} bytes without the blank line" in error["message"]


def test_a_flood_before_the_first_token_is_refused(proxy: tuple[str, list[dict[str, str]], Any]) -> None:
    """Item 13: comments past MAX_HELD_BYTES before any output fail the attempt with a 502 (before:
    all of it was held, then relayed)."""
    base, _, _ = proxy
    flood = b": keep-alive\n\n" * (MAX_HELD_BYTES // 7)  # twice the limit
    r = _post(base, "flood", _framed(flood + b"data: " + _delta("hi") + b"\n\ndata: [DONE]\n\n", "close"))
    assert r.status_code == 502, r.content[:200]
    assert f"more than {MAX_HELD_BYTES} bytes without an output event" in r.json()["error"]["message"]


def test_the_stream_limits_are_settings() -> None:
    """Item 13: [server] max_sse_event_bytes and max_sse_held_bytes bound a stream (before: the
    settings did not exist, the 8 MiB constants held whatever the configuration said)."""
    bodies: dict[str, bytes] = {}
    with scripted_upstream(bodies) as (url, _):
        s = make_settings(("raw", url), server={"max_sse_event_bytes": 4096, "max_sse_held_bytes": 2048})
        s.retry.max_attempts = 1
        s.timeouts.idle = 5
        with run_proxy(s) as base:
            first = b"data: " + _delta("hi") + b"\n\n"
            # No blank line after it: an event that is complete in one read is not held, whatever its size.
            big = first + b"data: " + b"x" * 100_000 + b"\ndata: more\n"
            r = _post_to(base, bodies, "big", _framed(big, "close"))
            if r.status_code == 200:
                assert r.content.startswith(first)
                error = json.loads(sse_events(r.content)[-1])["error"]
            else:  # the first event and the line came in one read: the attempt failed before commit
                assert r.status_code == 502
                error = r.json()["error"]
            assert "more than 4096 bytes without the blank line" in error["message"]
            # Without an output event (one in the same read would end the count there).
            flood = b": keep-alive\n\n" * 300
            r = _post_to(base, bodies, "flood", _framed(flood, "close"))
            assert r.status_code == 502, r.content[:200]
            assert "more than 2048 bytes without an output event" in r.json()["error"]["message"]
            # Under both limits: relayed whole.
            fine = b": keep-alive\n\n" * 100 + first + b"data: " + _delta("y" * 3000) + b"\n\n"
            fine += b"data: [DONE]\n\n"
            r = _post_to(base, bodies, "fine", _framed(fine, "close"))
            assert r.status_code == 200 and r.content == fine


def _post_to(base: str, bodies: dict[str, bytes], case: str, body: bytes) -> httpx.Response:
    bodies[case] = body
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return httpx.post(base + "/v1/chat/completions", json=req, headers={"x-test-case": case}, timeout=60)


def test_a_compressed_stream_is_refused(proxy: tuple[str, list[dict[str, str]], Any]) -> None:
    """Item 14: infertap asks for identity; a gzip stream anyway fails the attempt with a clear
    502 (before: 200, the compressed bytes, then a plaintext error appended to them)."""
    base, seen, _ = proxy
    stream = b"data: " + _delta("hi") + b"\n\ndata: [DONE]\n\n"
    zipped = HEAD + b"content-encoding: gzip\r\nconnection: close\r\n\r\n" + gzip.compress(stream)
    r = _post(base, "gzip", zipped)
    assert seen[-1]["accept-encoding"] == "identity"
    assert r.status_code == 502
    assert "content-encoding 'gzip'" in r.json()["error"]["message"]


GOOD = b"".join(b"data: " + _delta(w) + b"\n\n" for w in ("one", " two", " three")) + b"data: [DONE]\n\n"


@st.composite
def garbled(draw: st.DrawFn) -> tuple[bytes, str, bool]:
    """A good stream with garbage injected at a random point: random bytes, a lone CR, an endless
    line, a bogus chunk header; framed by chunks, a length or the close; then closed, or held open."""
    at = draw(st.integers(0, len(GOOD)))
    junk = draw(
        st.one_of(
            st.binary(min_size=1, max_size=64),
            st.sampled_from([b"\r", b"\x00\xff\xfe", b'data: {"choices\n', b"zz\r\n", b"\r\n\r\n"]),
        )
    )
    framing = draw(st.sampled_from(["chunked", "length", "close", "raw-chunked"]))
    body = GOOD[:at] + junk + GOOD[at:]
    if framing == "raw-chunked":  # the garbage breaks the chunked framing itself
        head = _framed(GOOD[:at], "chunked")[: -len(b"0\r\n\r\n")]
        return (
            head + junk + _framed(GOOD[at:], "chunked").split(b"\r\n\r\n", 1)[1],
            framing,
            draw(st.booleans()),
        )
    return _framed(body, framing), framing, draw(st.booleans())


@E2E
@given(case=garbled())
@example(case=(_framed(GOOD[:40] + b"\r" + GOOD[40:], "close"), "close", True))
def test_garbage_anywhere_ends_the_stream_with_whole_events(
    proxy: tuple[str, list[dict[str, str]], RecordingObserver], case: tuple[bytes, str, bool]
) -> None:
    """Item 15: whatever the upstream sends, the client gets well-formed events and the stream ends
    (with [DONE] or infertap's error event), within the idle timeout, and the request has exactly
    one terminal hook."""
    base, _, rec = proxy
    raw, _, hold = case
    r = _post(base, "garbled", raw, hold)
    rid = r.headers["x-request-id"]
    rec.wait_terminal(rid)
    assert rec.terminal_count(rid) == 1
    if r.status_code != 200:
        assert r.json()["error"]["message"].startswith("upstream 'raw'")
        return
    events = sse_events(r.content)
    assert events, r.content
    last = events[-1]
    assert last == b"[DONE]" or "error" in json.loads(last), r.content[-200:]
