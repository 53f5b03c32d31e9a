"""`[server] stream_headers = "immediately"`: a generation stream's status and headers go out before
its first attempt, and SSE comments keep the connection alive until its first output event: the
upstream's own, passed through as they arrive, and infertap's after a quiet interval.

The trade (docs/resilience.md): a client whose own timeout is shorter than the time to first token,
or a load balancer that cuts a silent connection, no longer fails; in exchange an error before the
first token can no longer be an HTTP status, and ends the stream in-band (the route's error event)
after a 200. Retries and fallbacks before the first output event stay invisible: the comments are
not events, and no other upstream byte is relayed before the commit.
"""

from __future__ import annotations

import asyncio
from typing import Final

import orjson

from proxy.core.asgi import RawHeaders, Send, Watcher, send_error
from proxy.core.exchange import Outcome
from proxy.core.forward.attempts import Call, Ready
from proxy.core.forward.relay import status_outcome
from proxy.core.model_routing import Upstream

KEEP_ALIVE: Final = b": keep-alive\n\n"

# What an early stream says about itself: the upstream's own headers are not known yet, and are
# never relayed (a later upstream's could not be sent anyway, the status line being gone).
_SSE_HEADERS: Final[RawHeaders] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _Waiting:
    """An early stream before its first output event: infertap's keep-alive comments, and the
    upstream's own comments passed through as they arrive (a load balancer sees the upstream's
    traffic; infertap's own comment goes only after `interval` without any)."""

    __slots__ = ("send", "interval", "last")

    def __init__(self, send: Send, interval: float) -> None:
        self.send = send
        self.interval = interval
        self.last = asyncio.get_running_loop().time()

    async def pass_comments(self, comments: bytes) -> None:
        """Whole comment events of the upstream's: no event a client acts on, so a retry after them
        stays invisible."""
        self.last = asyncio.get_running_loop().time()
        try:
            await self.send({"type": "http.response.body", "body": comments, "more_body": True})
        except (OSError, RuntimeError):
            return  # the client went away: the disconnect watcher ends the request

    async def keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        message = {"type": "http.response.body", "body": KEEP_ALIVE, "more_body": True}
        try:
            while True:
                wait = self.last + self.interval - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                self.last = loop.time()
                await self.send(message)
        except (OSError, RuntimeError):
            # The client went away (the disconnect watcher ends the request) or the answer already
            # ended: either way there is nothing left to keep alive.
            return


async def open_early(send: Send, call: Call, interval: float) -> None:
    """Sends 200 and the SSE headers now, and starts the keep-alive comments."""
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + call.rid})
    call.opened = True
    call.committed_sse = True  # whatever ends it from now on is an in-band event
    waiting = _Waiting(send, interval)
    call.pass_comments = waiting.pass_comments
    call.keep_alive = asyncio.create_task(waiting.keep_alive())


def quiet(call: Call) -> None:
    """Stops the keep-alive comments: before the first upstream bytes, or the stream's end.

    A comment is one whole `send`, and uvicorn writes a message whole once its send runs, so
    cancelling the task (parked in its sleep, or waiting for the socket to drain before writing)
    can never leave half a comment before what follows."""
    call.pass_comments = None
    task = call.keep_alive
    if task is not None:
        call.keep_alive = None
        task.cancel()


async def end_in_band(send: Send, call: Call, message: str, kind: str) -> None:
    """Ends an early stream with the route's error event: the failure before its first token."""
    quiet(call)
    await send({"type": "http.response.body", "body": call.error_event(message, kind), "more_body": False})


async def answer_error(
    send: Send,
    call: Call,
    watcher: Watcher,
    status: int,
    message: str,
    kind: str,
    code: str,
    extra: RawHeaders | None = None,
) -> None:
    """A failure before the first token: its HTTP error or, in an early stream, the in-band event."""
    if not call.opened:
        await send_error(send, status, message, kind, code, call.rid + (extra or []))
        return
    watcher.cancel()  # its answer complete, uvicorn reports a disconnect: not the client's
    await end_in_band(send, call, message, code)


def fits(ready: Ready, is_sse: bool) -> bool:
    """Whether an attempt's answer can go on in a stream already opened: an event stream with 200."""
    return ready.scanner is not None and is_sse and ready.resp.status == 200


async def end_with_answer(send: Send, call: Call, up: Upstream, ready: Ready) -> tuple[Outcome, str]:
    """An answer that does not fit an early stream (an error status, a body that is no event
    stream), told in-band: its status and, from an OpenAI-shaped error body, its message. The
    outcome is the one its status would have had with the headers at the first token."""
    status = ready.resp.status
    outcome = status_outcome(status) if status != 200 else Outcome.UPSTREAM_ERROR
    said = _error_message(ready.prefetched)
    msg = f"upstream '{up.name}' ({call.ex.upstream_url or up.display_url}) answered "
    if status == 200:
        msg += f"a stream with {ready.resp.headers.get('content-type') or 'no content type'}"
    else:
        msg += f"HTTP {status}" + (f": {said}" if said else "")
    await end_in_band(send, call, msg, outcome.value)
    return outcome, msg


def _error_message(body: bytes | None) -> str | None:
    if not body:
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = obj.get("error") if isinstance(obj, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None
