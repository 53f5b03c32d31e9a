"""A stream that fails after infertap committed to it ends with its API's own error event, and that
event starts on an event boundary, wherever the upstream stopped (issue 23, items 3 and 5).

Two recorded streams, a chat completion (vLLM's serialization, multi-byte text, usage, `[DONE]`)
and a Responses API answer, are cut at every byte offset against the relay (unit level), and at
offsets hypothesis picks through a real infertap in front of a raw upstream that sends that many
bytes and closes (chunked, with a Content-Length, or delimited by the close). The client must get
whole events only, each with JSON (or `[DONE]`) data, ending with the route's error event.

INFERTAP_CUT_EXAMPLES=2000 runs the end-to-end test long (CI: 30 examples, a few seconds).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from proxy.core.exchange import Exchange
from proxy.core.forward.relay import relay_sse
from proxy.core.hooks import ObserverSet
from proxy.core.route_table import CHAT, RESPONSES, Route
from proxy.sim.protocol import ResponsesRequest
from proxy.sim.responses import ResponsesFormat
from tests.conftest import make_settings, run_proxy
from tests.raw_upstream import chunked, not_found, raw_upstream

MODEL = "Qwen/Qwen2.5-7B-Instruct"


def _chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {
        "id": "chatcmpl-4f1d2b7e",
        "object": "chat.completion.chunk",
        "created": 1733300000,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


_WORDS = ["Prefill", " reads", " the", " prompt", " — ", "décodé", " 🚀", ' "quoted"', "\n"]
CHAT_STREAM = b"".join(
    [
        _chat_chunk({"role": "assistant", "content": ""}),
        *(_chat_chunk({"content": w}) for w in _WORDS),
        _chat_chunk({}, "stop"),
        b'data: {"id":"chatcmpl-4f1d2b7e","object":"chat.completion.chunk","created":1733300000,'
        b'"model":"Qwen/Qwen2.5-7B-Instruct","choices":[],'
        b'"usage":{"prompt_tokens":12,"total_tokens":21,"completion_tokens":9}}\n\n',
        b"data: [DONE]\n\n",
    ]
)


def _responses_stream() -> bytes:
    fmt = ResponsesFormat(MODEL, ResponsesRequest(input="hi"))
    fmt.id, fmt.item_id, fmt.created_at = "resp_68a1f0c2", "msg_68a1f0c3", 1733300000
    usage = {"prompt_tokens": 12, "completion_tokens": len(_WORDS), "total_tokens": 12 + len(_WORDS)}
    return fmt.first() + b"".join(fmt.token(w) for w in _WORDS) + fmt.end("stop", usage)


RESPONSES_STREAM = _responses_stream()
# name: (recorded stream, its route)
STREAMS: dict[str, tuple[bytes, Route]] = {
    "chat": (CHAT_STREAM, CHAT),
    "chat-crlf": (CHAT_STREAM.replace(b"\n", b"\r\n"), CHAT),
    "responses": (RESPONSES_STREAM, RESPONSES),
}
EVENTS = TypeAdapter(ResponseStreamEvent)
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n")


def whole_events(data: bytes) -> bytes:
    """The complete events at the start of `data` (what a client may be given of it)."""
    ends = [m.end() for m in _BOUNDARY.finditer(data)]
    return data[: ends[-1]] if ends else b""


def parse_sse(body: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each event, read as the SSE standard has a client read them; fails when
    the body ends inside an event (a client would drop it silently)."""
    assert body == b"" or _BOUNDARY.search(body[-4:]) is not None, f"ends mid-event: {body[-80:]!r}"
    events = []
    for raw in _BOUNDARY.split(body)[:-1]:
        name, data = None, []
        for line in re.split(r"\r\n|\r|\n", raw.decode("utf-8")):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        assert data, f"an event without data: {raw!r}"
        events.append((name, "\n".join(data)))
    return events


def check_ending(body: bytes, route: Route) -> str:
    """Whole events, each JSON or `[DONE]`, ending with `route`'s error event and no error before
    it; returns the error's message."""
    events = parse_sse(body)
    objs = [None if data == "[DONE]" else json.loads(data) for _, data in events]
    if route is RESPONSES:
        (name, _), (failed_name, _) = events[-2:]
        error, failed = objs[-2], objs[-1]
        assert (name, failed_name) == ("error", "response.failed"), events[-2:]
        for obj in (error, failed):
            EVENTS.validate_python(obj)  # the openai SDK's own types, strictly
        assert error["type"] == "error" and error["code"] and error["message"]
        assert error["error"] == {
            "type": error["code"],
            "code": error["code"],
            "message": error["message"],
            "param": None,
        }
        assert failed["response"]["status"] == "failed"
        assert failed["response"]["error"] == {"code": "server_error", "message": error["message"]}
        numbers = [o["sequence_number"] for o in objs if isinstance(o, dict) and "sequence_number" in o]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
        opened = [o["response"]["id"] for o in objs[:-2] if o and o["type"] == "response.created"]
        assert opened in ([], [failed["response"]["id"]])
        assert not any(o and o["type"] in ("error", "response.failed") for o in objs[:-2])
        return str(error["message"])
    last = objs[-1]
    assert isinstance(last, dict) and set(last) == {"error"}, events[-1]
    assert set(last["error"]) == {"message", "type", "param", "code"} and last["error"]["message"]
    assert not any(isinstance(o, dict) and "error" in o for o in objs[:-1])
    return str(last["error"]["message"])


# -- every offset, against the relay ------------------------------------------------------------


async def _relay_cut(data: bytes, route: Route, rng: random.Random) -> bytes:
    """What the client gets of a stream cut after `data`: the relay's bytes, then the in-band error."""
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["body"])

    async def chunks() -> Iterator[bytes]:  # type: ignore[misc]
        i = 0
        while i < len(data):
            size = rng.choice((1, 2, 3, rng.randint(1, 80), len(data)))
            yield data[i : i + size]
            i += size

    assert route.scanner is not None
    scanner = route.scanner()
    ex = Exchange("cut", route.label, "POST", route.path)
    await relay_sse(send, ex, ObserverSet(), chunks(), scanner)  # type: ignore[arg-type]
    msg = "upstream 'u' (http://127.0.0.1/v1) closed the connection mid-response"
    return b"".join(sent) + route.error_event(msg, "stream_interrupted", scanner.facts)


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_a_cut_at_any_byte_leaves_whole_events_then_the_error(name: str) -> None:
    stream, route = STREAMS[name]

    async def every_offset() -> None:
        for n in range(len(stream) + 1):
            body = await _relay_cut(stream[:n], route, random.Random(n))
            kept = whole_events(stream[:n])
            assert body.startswith(kept), f"cut at {n}: the complete events are not relayed unchanged"
            # The recorded events are whole and valid: what needs a look is the seam, the last of
            # them and what follows (the end-to-end test reads whole bodies).
            ends = [0] + [m.end() for m in _BOUNDARY.finditer(kept)]
            try:
                check_ending(body[ends[-2] if len(ends) > 1 else 0 :], route)
            except AssertionError as e:
                raise AssertionError(
                    f"cut at byte {n} of {len(stream)}: {e}\n{body[len(kept) - 60 :]!r}"
                ) from e

    asyncio.run(every_offset())


def test_responses_error_events_continue_the_numbering_and_the_response() -> None:
    body = RESPONSES_STREAM[: RESPONSES_STREAM.index(b"response.output_text.done") - len(b"event: ")]
    out = asyncio.run(_relay_cut(body, RESPONSES, random.Random(1)))
    events = [json.loads(data) for _, data in parse_sse(out)]
    *upstream, error, failed = events
    assert error["sequence_number"] == upstream[-1]["sequence_number"] + 1
    assert failed["sequence_number"] == error["sequence_number"] + 1
    created = upstream[0]["response"]
    assert failed["response"] == {
        **created,
        "status": "failed",
        "error": {"code": "server_error", "message": error["message"]},
        "incomplete_details": None,
    }


# -- end to end, through a real infertap --------------------------------------------------------


def _answer(path: str, headers: dict[str, str]) -> bytes:
    if "x-test-stream" not in headers:  # infertap's background model-list checks
        return not_found(path, headers)
    stream, _ = STREAMS[headers["x-test-stream"]]
    cut, framing = int(headers["x-test-cut-at"]), headers["x-test-framing"]
    if framing == "chunked":
        return chunked("200 OK", "text/event-stream", stream, cut, int(headers["x-test-piece"]))
    length = f"content-length: {len(stream)}\r\n" if framing == "length" else ""
    head = f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n{length}connection: close\r\n\r\n"
    return head.encode() + stream[:cut]


@pytest.fixture(scope="module")
def proxy() -> Iterator[tuple[str, str]]:
    with raw_upstream(_answer) as url:
        settings = make_settings(("cut", url))
        settings.retry.max_attempts = 1
        settings.circuit.min_calls = 1_000_000  # every request here fails on purpose
        with run_proxy(settings) as proxy:
            yield proxy, url


def _request(name: str) -> tuple[str, dict[str, Any]]:
    if STREAMS[name][1] is RESPONSES:
        return "/v1/responses", {"model": MODEL, "input": "hi", "stream": True}
    messages = [{"role": "user", "content": "hi"}]
    return "/v1/chat/completions", {
        "model": MODEL,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@st.composite
def cuts(draw: st.DrawFn) -> tuple[str, int, str, int]:
    name = draw(st.sampled_from(sorted(STREAMS)))
    return (
        name,
        draw(st.integers(0, len(STREAMS[name][0]))),
        draw(st.sampled_from(["chunked", "length", "close"])),
        draw(st.integers(1, 96)),
    )


@settings(
    max_examples=int(os.environ.get("INFERTAP_CUT_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cut=cuts())
@example(cut=("chat", CHAT_STREAM.index(b'"content":"Pre') + 12, "chunked", 64))  # the case
@example(cut=("chat", len(CHAT_STREAM) - 1, "close", 8))  # [DONE] without its blank line
# The whole stream, then a broken connection: the end marker went out, so nothing is appended.
@example(cut=("responses", len(RESPONSES_STREAM), "chunked", 1))
@example(cut=("chat", len(CHAT_STREAM), "chunked", 1))
@example(cut=("responses", RESPONSES_STREAM.index(b"response.output_text.delta") + 40, "length", 7))
def test_a_cut_upstream_through_infertap_ends_on_an_event_boundary(
    proxy: tuple[str, str], cut: tuple[str, int, str, int]
) -> None:
    base, upstream_url = proxy
    name, n, framing, piece = cut
    stream, route = STREAMS[name]
    path, body = _request(name)
    headers = {
        "x-test-stream": name,
        "x-test-cut-at": str(n),
        "x-test-framing": framing,
        "x-test-piece": str(piece),
    }
    r = httpx.post(base + path, json=body, headers=headers, timeout=30)
    if r.status_code != 200:
        # Cut before the first output event: nothing was committed, a plain JSON error says why.
        err = r.json()["error"]
        assert r.status_code == 502 and err["type"] == "stream_interrupted", r.text
        assert err["message"].startswith(f"upstream 'cut' ({upstream_url}) "), err
        return
    kept = whole_events(stream[:n])
    assert r.content.startswith(kept)
    if n == len(stream):
        # Whole, its end marker relayed: a connection broken after it (chunked framing without its
        # last chunk) is one a client cannot tell from a clean end, so nothing is added either.
        assert r.content == stream
        return
    message = check_ending(r.content, route)
    assert message.startswith(f"upstream 'cut' ({upstream_url}) "), message


def test_a_failed_responses_stream_ends_in_the_responses_shape(proxy: tuple[str, str]) -> None:
    """Cut on an event boundary (so that nothing but the shape is at stake), once by a broken
    connection and once by a clean end without `response.completed`: the raw bytes end with the
    Responses API's `error` and `response.failed` events, and the openai SDK raises the message,
    from a plain stream and from its accumulating stream helper."""
    base, upstream_url = proxy
    third_delta = (
        RESPONSES_STREAM.index(b"\n\n", RESPONSES_STREAM.index(b'"delta":"' + _WORDS[2].encode())) + 2
    )
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    for framing, said in (
        ("chunked", "closed the connection mid-response"),
        ("close", "without response.completed"),
    ):
        headers = {
            "x-test-stream": "responses",
            "x-test-cut-at": str(third_delta),
            "x-test-framing": framing,
            "x-test-piece": "50",
        }
        path, body = _request("responses")
        raw = httpx.post(base + path, json=body, headers=headers, timeout=30)
        assert raw.status_code == 200 and raw.content.startswith(RESPONSES_STREAM[:third_delta])
        assert said in check_ending(raw.content, RESPONSES)

        seen: list[str] = []
        with pytest.raises(openai.APIError) as raised:
            for event in client.responses.create(model=MODEL, input="hi", stream=True, extra_headers=headers):
                seen.append(event.type)
        assert seen.count("response.output_text.delta") == 3  # it failed after the answer had begun
        assert said in raised.value.message and f"upstream 'cut' ({upstream_url})" in raised.value.message
        with pytest.raises(openai.APIError) as raised:
            with client.responses.stream(model=MODEL, input="hi", extra_headers=headers) as events:
                for _ in events:
                    pass
        assert said in raised.value.message
    client.close()
