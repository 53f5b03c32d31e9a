"""A proxied request's lifetime around its attempts: the client's disconnect, the total deadline,
and shutdown. Whichever comes first ends the request, with its one terminal hook (through the forwarder's
`end`) and, where the client can still be told, a visible error: never a silent clean end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from proxy.core.asgi import Receive, Send, Watcher, current_task, deadline, send_error, watch_disconnect
from proxy.core.errors import ERRORS, ErrorKind, Phase, describe, failure_message
from proxy.core.exchange import Exchange, Outcome
from proxy.core.forward.attempts import Call
from proxy.core.forward.early import end_in_band, quiet
from proxy.core.forward.relay import take_facts
from proxy.core.stream_facts import StreamFacts

log = logging.getLogger("infertap.lifetime")


class Runner(Protocol):
    """What the lifetime needs of the forwarder: its open requests' tasks, whether it is shutting
    down, a call's run (attempts, commit and relay) and the request's one end (its terminal hook)."""

    tasks: set[asyncio.Task[Any]]
    shutting_down: bool

    async def run(self, send: Send, call: Call, watcher: Watcher) -> None: ...

    def end(
        self, ex: Exchange, outcome: Outcome, status: int | None = None, error: str | None = None
    ) -> None: ...


async def guarded(runner: Runner, receive: Receive, send: Send, call: Call) -> None:
    """Runs the exchange while a watcher cancels it the moment the client goes away.

    The cancellation reaches whatever is awaited (connect, the wait for headers, a read),
    and an upstream response left unread is closed, which closes its connection.
    """
    task = current_task()
    gone = False

    def left() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    ex = call.ex
    watcher = watch_disconnect(receive, left)
    total = call.upstream.total_timeout
    runner.tasks.add(task)
    try:
        async with deadline(None if total is None else total - (time.perf_counter() - ex.received_at)):
            await runner.run(send, call, watcher)
    except TimeoutError:
        whole = _whole(call)
        if whole is not None:  # the deadline fell after the stream's end marker: nothing is missing
            watcher.cancel()
            take_facts(ex, whole)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            runner.end(ex, Outcome.OK)
            return
        # The upstream of the attempt under way (or the last one) is the one that ran out the clock.
        phase = Phase.RESPONSE if call.committed else Phase.FIRST_TOKEN if ex.stream else Phase.HEADERS
        msg = failure_message(
            ex.upstream or call.upstream.name,
            ex.upstream_url or call.upstream.display_url,
            ErrorKind.TOTAL_TIMEOUT,
            "",
            phase,
            total,
        )
        kind, status, outcome = (
            ErrorKind.TOTAL_TIMEOUT,
            ERRORS[ErrorKind.TOTAL_TIMEOUT].status,
            Outcome.TOTAL_TIMEOUT,
        )
        if call.committed_sse:  # committed, or opened before its first token (forward/early.py)
            watcher.cancel()
            await end_in_band(send, call, msg, kind.value)
        elif call.committed:
            # A plain body cut short would look complete, and an error event appended to it
            # would corrupt it: the connection is aborted (the app returns unfinished).
            runner.end(ex, outcome, status, msg)
            return
        else:
            await send_error(send, status, msg, kind.value, kind.value, call.rid)
        runner.end(ex, outcome, status, msg)
    except asyncio.CancelledError:
        if not gone:
            # Shutting down: infertap's drain deadline (then the request ends here), or the
            # server's own last-resort cancel (then the cancellation goes on up).
            ours = runner.shutting_down
            if ours:
                task.uncancel()
            watcher.cancel()
            await _shutdown_end(runner, send, call)
            if not ours:
                raise
            return
        task.uncancel()
        whole = _whole(call)
        if whole is not None:
            # It left after the stream's end marker: it has the whole answer (a client may close at
            # [DONE] without waiting for the body's last empty chunk). That request went well.
            take_facts(ex, whole)
            runner.end(ex, Outcome.OK)
            return
        runner.end(ex, Outcome.CLIENT_DISCONNECT, 499, "the client disconnected")
    except Exception as e:
        log.exception("request %s failed inside infertap", ex.request_id)
        runner.end(ex, Outcome.UPSTREAM_ERROR, 500, f"internal error: {describe(e)}")
        raise
    finally:
        watcher.cancel()
        quiet(call)
        runner.tasks.discard(task)


async def _shutdown_end(runner: Runner, send: Send, call: Call) -> None:
    """A request cut by shutdown: an SSE error event, a 503 before commit, or (a plain body that
    cannot be finished) an aborted connection. Never a silent clean end. A stream cut after its
    end marker went out is whole, though: an error event after `[DONE]` would contradict it, so its
    body is ended as the upstream would have, outcome `ok`."""
    msg = "infertap is shutting down: the drain time ran out before this request finished; retry it"
    outcome = Outcome.SHUTDOWN
    whole = _whole(call)
    try:
        async with asyncio.timeout(1.0):  # a client that does not read cannot hold the exit
            if whole is not None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif call.committed_sse:
                await end_in_band(send, call, msg, outcome.value)
            elif not call.committed:
                await send_error(send, 503, msg, outcome.value, "shutting_down", call.rid)
    except (TimeoutError, OSError, RuntimeError):
        pass
    if whole is not None:
        take_facts(call.ex, whole)
        runner.end(call.ex, Outcome.OK)
    else:
        runner.end(call.ex, outcome, 503, msg)


def _whole(call: Call) -> StreamFacts | None:
    """The committed stream's facts when its end marker ([DONE], response.completed) was relayed
    without an error event: the client has the whole answer, whatever happens to the connection."""
    scanner = call.scanner if call.committed else None
    if scanner is None or not scanner.facts.done or scanner.facts.error_events:
        return None
    return scanner.facts
