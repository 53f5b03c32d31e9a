"""After a stream's end marker ([DONE]) has reached the client, the client has the whole answer:
whatever then happens to the connection (the client closes it at once, the upstream breaks it
before the body's last chunk, the total deadline falls), the request went well. Found by CI with
llama.cpp's server (the OpenAI SDK closed at [DONE] before the upstream's terminating chunk came:
`client_disconnect`) and in review (a break after [DONE] appended an error event to a whole
answer: `stream_interrupted`)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.core.asgi import Receive, Scope, Send
from tests.conftest import CHAT, RecordingObserver, make_settings, serve_in_thread
from tests.promtext import scrape, value
from tests.raw_upstream import raw_upstream

EVENTS = [
    {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [{"index": 0, "delta": d}]}
    for d in ({"role": "assistant"}, {"content": "Hello"}, {"content": " there"})
]
STREAM = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in EVENTS) + b"data: [DONE]\n\n"


async def held_open(scope: Scope, receive: Receive, send: Send) -> None:
    """Sends a whole stream, [DONE] included, and never ends the body: it waits for the disconnect."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    await send({"type": "http.response.body", "body": STREAM, "more_body": True})
    while (await receive())["type"] != "http.disconnect":
        pass


def broken_after_done(path: str, headers: dict[str, str]) -> bytes:
    """A chunked stream whose connection breaks after [DONE], before the terminating chunk."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"%x\r\n" % len(STREAM) + STREAM + b"\r\n"


def _run(url: str, rid: str, read_to_done: bool, **timeouts: Any) -> tuple[bytes, Any, str]:
    settings = make_settings(("up", url))
    for name, seconds in timeouts.items():
        setattr(settings.timeouts, name, seconds)
    rec = RecordingObserver()
    with serve_in_thread(create_app(settings, [rec])) as proxy:
        body = b""
        with httpx.stream(
            "POST",
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": False}},
            headers={"x-request-id": rid},
            timeout=30,
        ) as r:
            for chunk in r.iter_raw():
                body += chunk
                if read_to_done and b"[DONE]" in body:
                    break  # and close at once, as the OpenAI SDK does with client.close()
        ex = rec.wait_terminal(rid)
        metrics = scrape(proxy)
    return body, ex, metrics


@pytest.mark.parametrize("how", ["client closes at [DONE]", "total deadline after [DONE]"])
def test_a_stream_held_open_after_done_ends_well(how: str) -> None:
    with serve_in_thread(held_open) as url:
        if how == "client closes at [DONE]":
            body, ex, metrics = _run(url + "/v1", "held", read_to_done=True)
        else:
            body, ex, metrics = _run(url + "/v1", "held", read_to_done=False, total=1.0)
    assert body.startswith(STREAM[:20]) and b"[DONE]" in body
    assert b'"error"' not in body
    assert ex.outcome == "ok", (ex.outcome, ex.error_message)
    assert value(metrics, "infertap_requests_total", outcome="ok") == 1
    assert value(metrics, "infertap_requests_total", outcome="client_disconnect") == 0


def test_a_connection_broken_after_done_appends_nothing() -> None:
    with raw_upstream(broken_after_done) as url:
        body, ex, metrics = _run(url, "broken", read_to_done=False)
    assert body == STREAM, body[-200:]
    assert ex.outcome == "ok", (ex.outcome, ex.error_message)
    assert value(metrics, "infertap_requests_total", outcome="stream_interrupted") == 0


def test_a_break_before_done_is_still_an_interruption() -> None:
    """The other side: without [DONE] the answer is incomplete, and says so in-band."""
    cut = STREAM[: STREAM.index(b"data: [DONE]")]

    def broken_before_done(path: str, headers: dict[str, str]) -> bytes:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        return head + b"%x\r\n" % len(cut) + cut + b"\r\n"

    with raw_upstream(broken_before_done) as url:
        body, ex, _ = _run(url, "cut", read_to_done=False)
    assert ex.outcome == "stream_interrupted" and b'"error"' in body
