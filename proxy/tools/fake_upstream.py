"""A scriptable OpenAI-compatible upstream (tests, soak, benchmark), driven by request headers.

The client sets `x-fake-*` headers (infertap forwards them), so each test scripts its own
upstream behaviour while the same server instance records what it received and sent.

  x-fake-events: N          content events in a stream (default 5)
  x-fake-gap-ms: G          gap between content events
  x-fake-ttft-ms: T         delay before the first content event (the role chunk goes at once)
  x-fake-status: S          answer status S with an OpenAI-style error body
  x-fake-hang: WHERE        never go on: before-headers | after-role | after-first | mid-body |
                            after-done (mid-body: half of a whole JSON answer; after-done: the
                            stream's `data: [DONE]` sent, its body never ended)
  x-fake-no-done: 1         end the stream without `data: [DONE]`
  x-fake-cut: K             drop the connection after K content events
  x-fake-fail-first: N      answer the first N requests of a request id with x-fake-fail-status
                            (default 503) and x-fake-retry-after, then behave normally
  x-fake-malformed: 1       content events carry broken JSON
  x-fake-event-bytes: B     each content event carries B bytes of text
  x-fake-reject-stream-options: 1   answer 400 naming stream_options to a request that has it
  x-fake-delay-ms: D        wait D ms before answering at all
  x-fake-prompt-tokens: P   usage's prompt tokens (default 7)
  x-fake-cached: C          usage reports C prompt tokens served from the prefix cache
  x-fake-reasoning: R       R `reasoning_content` events before the content (a reasoning model);
                            usage counts them in completion tokens and in reasoning_tokens
  x-fake-answer-ms: A       delay between the last reasoning event and the first content event
  x-fake-gate: NAME         after the first content event, wait until the test calls open_gate(NAME)
                            (a stream held in flight for as long as a test needs, with no sleep)
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from proxy.core.asgi import Receive, Scope, Send, watch_disconnect


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    raw_path: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


def _usage(h: dict[str, str], n: int) -> dict[str, Any]:
    prompt = int(h.get("x-fake-prompt-tokens", "7"))
    reasoning = int(h.get("x-fake-reasoning", "0"))
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": n + reasoning,
        "total_tokens": prompt + n + reasoning,
    }
    if "x-fake-cached" in h:
        usage["prompt_tokens_details"] = {"cached_tokens": int(h["x-fake-cached"])}
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def _chunk(
    cid: str, model: str, delta: dict[str, Any], finish: str | None = None, usage: bool = False
) -> bytes:
    obj: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage:
        obj["usage"] = None
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class FakeUpstream:
    requests: list[Received] = field(default_factory=list)
    sent: dict[str, bytearray] = field(default_factory=dict)  # x-request-id -> bytes streamed
    disconnected: threading.Event = field(default_factory=threading.Event)
    send_times: dict[str, list[float]] = field(default_factory=dict)
    arrivals: list[float] = field(default_factory=list)
    failures_left: dict[str, int] = field(default_factory=dict)
    checks: list[Received] = field(default_factory=list)  # infertap's background GET /models
    gates: dict[str, threading.Event] = field(default_factory=dict)

    def open_gate(self, name: str) -> None:
        """Lets the streams held by `x-fake-gate: NAME` go on (from any thread)."""
        self.gates.setdefault(name, threading.Event()).set()

    async def _pass_gate(self, name: str) -> None:
        gate = self.gates.setdefault(name, threading.Event())
        while not gate.is_set():  # a thread's Event, polled: tests open it from their own thread
            await asyncio.sleep(0.01)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        rec = Received(scope["method"], scope["path"], headers, body, scope.get("raw_path") or b"")
        if headers.get("user-agent", "").endswith("upstream-check"):
            self.checks.append(rec)  # kept apart: tests count the requests that clients caused
        else:
            self.requests.append(rec)
            self.arrivals.append(time.monotonic())

        task = asyncio.current_task()
        assert task is not None
        gone = False

        def left() -> None:
            nonlocal gone
            gone = True
            self.disconnected.set()
            task.cancel()

        watcher = watch_disconnect(receive, left)
        try:
            await self._answer(rec, send)
        except asyncio.CancelledError:
            if not gone:
                raise
        finally:
            watcher.cancel()

    async def _answer(self, rec: Received, send: Send) -> None:
        h = rec.headers
        if h.get("x-fake-hang") == "before-headers":
            await asyncio.Event().wait()
        if "x-fake-delay-ms" in h:
            await asyncio.sleep(float(h["x-fake-delay-ms"]) / 1000)
        status = int(h.get("x-fake-status", "200"))
        if "x-fake-fail-first" in h:
            rid = h.get("x-request-id", "")
            left = self.failures_left.setdefault(rid, int(h["x-fake-fail-first"]))
            if left > 0:
                self.failures_left[rid] = left - 1
                extra = (
                    [(b"retry-after", h["x-fake-retry-after"].encode())] if "x-fake-retry-after" in h else []
                )
                await _json(
                    send,
                    int(h.get("x-fake-fail-status", "503")),
                    {"error": {"message": "fake transient failure", "type": "fake"}},
                    extra,
                )
                return
        if rec.path.endswith("/models"):
            await _json(
                send,
                200,
                {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "fake"}]},
            )
            return
        if status != 200:
            await _json(
                send, status, {"error": {"message": f"fake error {status}", "type": "fake", "code": status}}
            )
            return
        req = rec.json() if rec.body else {}
        if h.get("x-fake-reject-stream-options") == "1" and "stream_options" in req:
            msg = "stream_options is not supported by this server"
            await _json(send, 400, {"error": {"message": msg, "type": "invalid_request_error"}})
            return
        if rec.path.endswith("/embeddings"):
            await _json(
                send,
                200,
                {
                    "object": "list",
                    "model": req.get("model"),
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                    "usage": {"prompt_tokens": 3, "total_tokens": 3},
                },
            )
            return
        n = int(h.get("x-fake-events", "5"))
        model = req.get("model", "fake-model")
        if not req.get("stream"):
            answer = {
                "id": "cmpl-fake",
                "object": "chat.completion",
                "created": 1700000000,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "tok " * n},
                        "finish_reason": "stop",
                    }
                ],
                "usage": _usage(h, n),
            }
            if h.get("x-fake-hang") == "mid-body":
                data = json.dumps(answer).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True})
                await asyncio.Event().wait()
            await _json(send, 200, answer)
            return
        await self._stream(rec, req, send, n, model)

    async def _stream(self, rec: Received, req: dict[str, Any], send: Send, n: int, model: str) -> None:
        h = rec.headers
        rid = h.get("x-request-id", "")
        gap = float(h.get("x-fake-gap-ms", "0")) / 1000
        ttft = float(h.get("x-fake-ttft-ms", "0")) / 1000
        cut = int(h["x-fake-cut"]) if "x-fake-cut" in h else None
        hang = h.get("x-fake-hang")
        usage = bool((req.get("stream_options") or {}).get("include_usage"))
        malformed = h.get("x-fake-malformed") == "1"
        pad = "x" * int(h.get("x-fake-event-bytes", "0"))
        sent = bytearray()
        times: list[float] = []
        self.sent[rid] = sent
        self.send_times[rid] = times

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})
            sent.extend(data)
            times.append(time.perf_counter())

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                # As sse-starlette (and so vLLM's and many servers' streams) sends it.
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        await emit(_chunk("chatcmpl-fake", model, {"role": "assistant", "content": ""}, usage=usage))
        if hang == "after-role":
            await asyncio.Event().wait()
        if ttft:
            await asyncio.sleep(ttft)
        reasoning = int(h.get("x-fake-reasoning", "0"))
        for i in range(reasoning):
            if i and gap:
                await asyncio.sleep(gap)
            await emit(_chunk("chatcmpl-fake", model, {"content": None, "reasoning_content": f"hm{i} "}))
        if reasoning and "x-fake-answer-ms" in h:
            await asyncio.sleep(float(h["x-fake-answer-ms"]) / 1000)
        for i in range(n):
            if i and gap:
                await asyncio.sleep(gap)
            if cut is not None and i == cut:
                raise ConnectionAbortedError("fake upstream cuts the stream")
            if malformed:
                await emit(b'data: {"choices": [{"delta": {"content": "tok' + str(i).encode() + b'"\n\n')
            else:
                await emit(_chunk("chatcmpl-fake", model, {"content": f"tok{i} {pad}"}, usage=usage))
            if hang == "after-first":
                await asyncio.Event().wait()
            if i == 0 and "x-fake-gate" in h:
                await self._pass_gate(h["x-fake-gate"])
        await emit(_chunk("chatcmpl-fake", model, {}, finish="stop", usage=usage))
        if usage:
            obj = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 1700000000,
                "model": model,
                "choices": [],
                "usage": _usage(h, n),
            }
            await emit(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        if h.get("x-fake-no-done") != "1":
            await emit(b"data: [DONE]\n\n")
        if hang == "after-done":
            await asyncio.Event().wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _json(send: Send, status: int, obj: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})
