"""Small ASGI helpers: request bodies, header lists, OpenAI-style JSON errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body: bytes = message.get("body", b"")
        if body:
            size += len(body)
            if size > limit:
                raise BodyTooLarge
            chunks.append(body)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Watcher(Protocol):
    """A disconnect watch: cancelled when the answer is done (an asyncio.Task is one)."""

    def cancel(self) -> object: ...


def watch_disconnect(receive: Receive, on_gone: Callable[[], object]) -> Watcher:
    """The one disconnect watcher (the core, the simulated engine, the test upstream): calls
    `on_gone` when the client disconnects. A streamed answer notices a disconnect only at its next
    send; whatever is awaited meanwhile (an upstream, a queue) would hold on. Cancel the watch when
    the answer is done.

    Where `receive` is a bound method of an object that can watch its connection itself (the raw
    cycle's `watch_disconnect`: a callback from the protocol's `connection_lost`), that does it;
    anywhere else (uvicorn's ASGI cycle, a test driving the app through ASGI) a task reads what is
    left of the request until `http.disconnect`: a task per request (created, scheduled, cancelled),
    about 3% of a small request's instructions in infertap (docs/benchmarks.md)."""
    watch_itself = getattr(getattr(receive, "__self__", None), "watch_disconnect", None)
    if watch_itself is not None:
        watcher: Watcher = watch_itself(on_gone)
        return watcher

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        on_gone()

    return asyncio.create_task(watch())


# `async with deadline(seconds)`: a request's deadlines are often none (total, a plain answer's
# TTFT), and asyncio.timeout(None) still costs its Timeout, the task lookup and two reschedules.
_NO_DEADLINE = contextlib.nullcontext()


def deadline(seconds: float | None) -> contextlib.AbstractAsyncContextManager[object]:
    """A `Deadline` of `seconds`, or nothing at all when there is none."""
    return _NO_DEADLINE if seconds is None else Deadline(seconds)


def current_task() -> asyncio.Task[Any]:
    """asyncio.current_task(), never None (a RuntimeError outside a task).

    Not through a loop found before: a loop kept from one call to the next may be running in
    another thread at the next (tests run several servers in threads), and asyncio.current_task(
    that loop) then answers with that thread's task (tests/test_deadline.py). asyncio's own lookup
    of the running loop costs a getpid(2) in Python 3.11: one a call."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("not called from a task")
    return task


class Deadline:
    """`asyncio.timeout(seconds)` for a deadline that never moves: the body is cancelled when it
    runs out, and that cancellation leaves the block as TimeoutError, unless another cancellation
    of the task came meanwhile (asyncio.timeout's rule, with `uncancel`); any other cancellation
    goes through unchanged. Less work than asyncio.timeout (measured: about 18k instructions to
    its 29k a block, one getpid(2) to its three); tests/test_deadline.py holds the two to the same
    answers."""

    __slots__ = ("_seconds", "_task", "_handle", "_cancelling", "_expired")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._task: asyncio.Task[Any] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._cancelling = 0
        self._expired = False

    async def __aenter__(self) -> Deadline:
        task = self._task = current_task()
        self._cancelling = task.cancelling()
        loop = task.get_loop()
        self._handle = loop.call_at(loop.time() + self._seconds, self._expire)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
        if self._expired:
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def _expire(self) -> None:
        self._handle = None
        self._expired = True
        assert self._task is not None
        self._task.cancel()


def body_arrived(receive: Receive) -> bool:
    """Whether the request's whole body is already in the server's hands, so that reading it cannot
    wait: uvicorn's cycle and infertap's raw cycle both keep `more_body`, False once llhttp has
    seen the message's end. Anything else (a test's receive) reads as not arrived."""
    return getattr(getattr(receive, "__self__", None), "more_body", True) is False


def header(scope: Scope, name: bytes) -> str | None:
    # Typed, so that compiled the pairs are unpacked and compared natively (a fifth of the cost).
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code or kind}})


async def send_json(send: Send, status: int, payload: bytes, extra_headers: RawHeaders | None = None) -> None:
    headers: RawHeaders = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def send_error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    extra_headers: RawHeaders | None = None,
    param: str | None = None,
) -> None:
    await send_json(send, status, error_body(message, kind, code, param), extra_headers)
