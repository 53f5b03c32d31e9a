"""The streaming core: intake, attempts across upstreams and fallbacks, commit, exactly one terminal hook.

(One attempt, up to its commit point, is attempts.py's; relaying a committed answer, relay.py's;
the request's lifetime around its attempts (disconnect, total deadline, shutdown), lifetime.py's;
the request record from the body, intake.py's.)

No Prometheus and no OpenTelemetry here (lint enforces it): observers turn the Exchange into those.

Nothing reaches the client before an attempt is committed. A generation stream is committed at
its first output event (not at the upstream's headers), so an upstream that stalls or breaks
before the first token is retried, or replaced by a fallback, without the client noticing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from proxy.core.asgi import (
    BodyTooLarge,
    ClientGone,
    RawHeaders,
    Receive,
    Scope,
    Send,
    Watcher,
    body_arrived,
    deadline,
    read_body,
    send_error,
)
from proxy.core.circuit import PANIC, Permit
from proxy.core.errors import ERRORS, ErrorKind, Phase, outcome_of
from proxy.core.exchange import Exchange, Outcome
from proxy.core.forward import pooled
from proxy.core.forward.attempts import Attempter, Call, Failure, Ready, say
from proxy.core.forward.early import answer_error, end_with_answer, fits, open_early, quiet
from proxy.core.forward.intake import RequestRejected, affinity_key, fill_record, parse_request, with_usage
from proxy.core.forward.lifetime import guarded
from proxy.core.forward.relay import (
    relay_committed,
    relayed_length,
    response_headers,
    status_outcome,
    take_facts,
    whole_body_headers,
)
from proxy.core.headers import forwarded_headers, forwarded_query
from proxy.core.hooks import ObserverSet
from proxy.core.model_routing import ModelRouter, Upstream
from proxy.core.paths import PathRejected, passthrough_suffix
from proxy.core.replicas import Replica
from proxy.core.request_ids import RequestIds
from proxy.core.route_table import OTHER, Route
from proxy.core.seam import UpstreamClient
from proxy.core.sse import MAX_EVENT_BYTES, MAX_HELD_BYTES
from proxy.core.stream_facts import StreamFacts
from proxy.settings import DEFAULT_PROMPT_CLASS_BOUNDS

log = logging.getLogger("infertap.forward")


class Forwarder:
    def __init__(
        self,
        routing: ModelRouter,
        client: UpstreamClient,
        observers: ObserverSet,
        max_body_bytes: int,
        prompt_class_bounds: tuple[int, ...] = DEFAULT_PROMPT_CLASS_BOUNDS,
        max_concurrency: int = 0,
        when_all_open: str = "send",
        request_ids: RequestIds | None = None,
        stream_headers: str = "first_token",
        keep_alive_seconds: float = 5.0,
        body_timeout: float | None = None,
        stream_limits: tuple[int, int] = (MAX_EVENT_BYTES, MAX_HELD_BYTES),
    ) -> None:
        self.body_timeout = body_timeout
        self.routing = routing
        self.attempter = Attempter(client, observers, *stream_limits)
        self.observers = observers
        self.max_body_bytes = max_body_bytes
        self.prompt_class_bounds = prompt_class_bounds
        self.max_concurrency = max_concurrency
        self.active = 0
        self.request_id = request_ids if request_ids is not None else RequestIds()
        self.panic = when_all_open == "send"
        self.early = stream_headers == "immediately"  # forward/early.py
        self.keep_alive_seconds = keep_alive_seconds
        # Request tasks, so that the end of a drain can end them with a visible error.
        self.tasks: set[asyncio.Task[Any]] = set()
        self.shutting_down = False

    def shut_down(self) -> None:
        """The drain's deadline: every request still open ends now, each with a visible error."""
        self.shutting_down = True
        for task in list(self.tasks):
            task.cancel()

    # -- request intake ---------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        ex = Exchange(self.request_id(scope), route.label, scope["method"], scope["path"])
        ex.client = scope.get("infertap.client", ex.client)
        for key, value in scope["headers"]:
            if key == b"traceparent" or key == b"tracestate":
                ex.trace_context[key.decode()] = value.decode("latin-1")
        rid = [(b"x-request-id", ex.request_id.encode())]
        if route is OTHER:
            try:
                suffix = passthrough_suffix(scope)
            except PathRejected as e:
                await self._reject(send, ex, rid, e.status, f"{e}: {scope['path']!r}", e.code)
                return
        else:
            suffix = scope["path"][3:]  # one of the known routes, matched exactly
        if self.max_concurrency and self.active >= self.max_concurrency:
            await self._reject(
                send,
                ex,
                rid,
                429,
                f"infertap is at its limit of {self.max_concurrency} concurrent requests: retry shortly",
                "too_many_requests",
                kind=Outcome.RATE_LIMITED.value,
                extra=[(b"retry-after", b"1")],
            )
            return
        # Counted from here, before the body is read: a slow upload holds its place under the cap.
        self.active += 1
        try:
            await self._intake(scope, receive, send, ex, route, rid, suffix)
        finally:
            self.active -= 1

    async def _intake(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        ex: Exchange,
        route: Route,
        rid: RawHeaders,
        suffix: str,
    ) -> None:
        try:
            # A body that has all arrived (most: it comes with the head) needs no deadline.
            async with deadline(None if body_arrived(receive) else self.body_timeout):
                body = await read_body(receive, self.max_body_bytes)
        except TimeoutError:
            # A body that trickles in (or never comes) holds a connection and a task: it has a deadline
            # of its own, as the head has at the edge.
            msg = f"the request body did not arrive within {self.body_timeout:g} s"
            await self._reject(send, ex, rid, 408, msg, "request_timeout")
            return
        except ClientGone:
            # Counted and logged like any request: it reached infertap, and its client left.
            self.observers.request_received(ex)
            msg = "the client disconnected before its request was complete"
            self.end(ex, Outcome.CLIENT_DISCONNECT, 499, msg)
            return
        except BodyTooLarge:
            msg = f"the request body is larger than the limit of {self.max_body_bytes} bytes"
            await self._reject(send, ex, rid, 413, msg, "request_too_large")
            return
        try:
            obj = parse_request(route, body)
        except RequestRejected as e:
            await self._reject(send, ex, rid, e.status, e.message, e.code, e.param)
            return
        original = body
        if obj is not None:
            fill_record(ex, obj, self.prompt_class_bounds)
        routing = self.routing  # this request's: a reload swaps self.routing for new requests only
        upstream = routing.route(ex.model)
        ex.upstream = upstream.name
        ex.upstream_url = upstream.display_url
        if obj is not None and ex.stream and route.stream_options:
            body = with_usage(ex, obj, body, upstream.name in self.attempter.no_stream_options)
        suffix += forwarded_query(scope.get("query_string", b""))
        headers = forwarded_headers(scope["headers"], scope.get("client"), upstream.request_policy)
        if route.json_body and "content-type" not in headers:
            # The body was read as JSON; without this an engine (FastAPI) sees octet-stream and refuses it.
            headers["content-type"] = "application/json"
        call = Call(ex, route, upstream, suffix, headers, body, original, rid)
        call.client_headers = scope["headers"]
        call.client_addr = scope.get("client")
        call.plan = routing.plan(upstream)
        header = routing.affinity_header(upstream)
        if header is not None:
            call.affinity = affinity_key(obj, scope["headers"], header)
        self.observers.request_received(ex)
        await self._guarded(receive, send, call)

    async def _reject(
        self,
        send: Send,
        ex: Exchange,
        rid: RawHeaders,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        extra: RawHeaders | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        self.observers.request_received(ex)
        await send_error(send, status, message, kind, code, rid + (extra or []), param)
        self.end(ex, Outcome.REJECTED, status, message)

    def end(
        self, ex: Exchange, outcome: Outcome, status: int | None = None, error: str | None = None
    ) -> None:
        """The one terminal hook of a request."""
        if ex.finished_at is not None:
            return
        ex.finished_at = time.perf_counter()
        ex.outcome = outcome
        if status is not None and ex.status_code is None:
            ex.status_code = status
        if error is not None:
            ex.error_message = error
        if outcome is Outcome.OK:
            self.observers.finished(ex)
        elif outcome is Outcome.CLIENT_DISCONNECT:
            self.observers.client_disconnected(ex)
        else:
            self.observers.failed(ex)

    # -- the request's lifetime: disconnects, the total deadline, shutdown (lifetime.py) --------------
    async def _guarded(self, receive: Receive, send: Send, call: Call) -> None:
        await guarded(self, receive, send, call)

    # -- attempts, fallback, circuit --------------------------------------------------------
    async def run(self, send: Send, call: Call, watcher: Watcher) -> None:
        ex = call.ex
        plan = call.plan
        if self.early and ex.stream and call.route.scanner is not None:
            await open_early(send, call, self.keep_alive_seconds)
        now = time.monotonic()
        # Only asks: the permit is taken right before an attempt goes (a fallback the request
        # never reaches must not hold its upstream's probe slot).
        usable = [up for up in plan if up.available(now)]
        panic = False
        if not usable:
            if not self.panic:
                await self._circuit_open(send, call, plan, watcher)
                return
            usable, panic = list(plan), True  # no healthy alternative left: keep sending
        failure: Failure | None = None
        # A retry is counted (the `retry` hook) when the next attempt really goes, not when it is
        # planned: an upstream whose circuit opened meanwhile, or another request's probe, can leave
        # nothing to try, and a retry counted then would be one that never happened.
        retry: tuple[str, float] | None = None
        exhausted = False
        tried: list[Replica] = []  # a pool's replicas this request tried: a retry goes elsewhere
        for i, up in enumerate(usable):
            policy = up.retry
            pool = up.replicas
            attempt = 0
            while attempt < policy.max_attempts:
                attempt += 1
                replica: Replica | None = None
                breaker = up.breaker
                if pool is not None:
                    replica, reason = pool.choose(call.affinity, tried, panic)
                    if replica is None:
                        break  # no replica may take it: on to the fallback
                    breaker = replica.breaker
                permit = PANIC if panic else breaker.acquire(time.monotonic())
                if permit is None:
                    break  # opened meanwhile, or another request is its probe: on to the fallback
                if retry is not None:
                    ex.retries += 1
                    self.observers.retry(ex, *retry)
                    retry = None
                last = i == len(usable) - 1 and attempt == policy.max_attempts
                result: Ready | Failure | None = None
                if replica is not None:
                    pooled.take(self.observers, ex, up, replica, tried, reason)
                try:
                    result = await self.attempter.run(call, up, last, replica)
                    if isinstance(result, Ready):
                        status = result.resp.status
                        self._health(
                            ex,
                            up,
                            permit,
                            status < 500,
                            f"upstream '{up.name}' ({ex.upstream_url}) answered HTTP {status}",
                            replica,
                        )
                    elif result.kind is not ErrorKind.POOL_TIMEOUT:  # no call went: nothing to judge
                        self._health(
                            ex, up, permit, not ERRORS[result.kind].unhealthy, result.message, replica
                        )
                finally:
                    breaker.release(permit)
                    if replica is not None and not isinstance(result, Ready):
                        failed = None if result is None else outcome_of(result.kind).value
                        pooled.release(self.observers, ex, up, replica, False, failed)
                if isinstance(result, Ready):
                    try:
                        await self._commit(send, call, up, result, watcher)
                    finally:
                        if replica is not None:
                            pooled.release(self.observers, ex, up, replica, True, None)
                    return
                assert result is not None
                failure = result
                ex.attempt_failed_at = time.perf_counter()
                if failure.kind is ErrorKind.STREAM_OPTIONS:
                    # infertap's own addition failed, not the upstream: at once, and off the budget
                    # (it happens once per request: the body no longer has it).
                    attempt -= 1
                    retry = (failure.kind.value, 0.0)
                    continue
                if last:
                    break
                now = time.monotonic()
                if attempt < policy.max_attempts and (panic or up.available(now)):
                    wait = policy.backoff(attempt) if failure.wait is None else failure.wait
                    if pool is not None and any(
                        r.admitted(now) and r not in tried for r in pool.current().members
                    ):
                        wait = 0.0  # another replica goes next: this one's trouble is not its
                    retry = (failure.kind.value, min(wait, policy.max_backoff_seconds))
                    if retry[1] > 0:
                        await asyncio.sleep(retry[1])
                elif panic or any(later.available(now) for later in usable[i + 1 :]):
                    retry = (failure.kind.value, 0.0)  # on to the fallback
                    break
                else:
                    # Its own failure just opened the last circuit there was: nothing follows, so
                    # neither a backoff (up to Retry-After's 30 s) nor a retry that never happens.
                    exhausted = True
                    break
            if exhausted:
                break
        if failure is None:
            await self._circuit_open(send, call, plan, watcher)
            return
        kind = failure.kind.value
        await answer_error(send, call, watcher, failure.status, failure.message, kind, kind)
        self.end(ex, outcome_of(failure.kind), failure.status, failure.message)

    async def _circuit_open(self, send: Send, call: Call, plan: list[Upstream], watcher: Watcher) -> None:
        now = time.monotonic()
        msg = "; ".join(f"upstream '{up.name}' is unavailable: {up.describe(now)}" for up in plan)
        wait = str(max(1, math.ceil(min(up.retry_in(now) for up in plan)))).encode()
        kind = Outcome.UPSTREAM_ERROR.value
        await answer_error(send, call, watcher, 503, msg, kind, "circuit_open", [(b"retry-after", wait)])
        self.end(call.ex, Outcome.UPSTREAM_ERROR, 503, msg)

    def _health(
        self, ex: Exchange, up: Upstream, permit: Permit, ok: bool, cause: str, replica: Replica | None = None
    ) -> None:
        if replica is not None:
            pooled.judge(self.observers, up, replica, permit, ok, cause)
            return
        if up.breaker.record(permit, ok, time.monotonic(), None if ok else cause):
            now_up = not up.breaker.is_open
            if now_up:
                log.warning("upstream %s: circuit closed (the probe succeeded)", up.name)
            else:
                log.warning(
                    "upstream %s: circuit open (upstream skipped): %s",
                    up.name,
                    up.breaker.describe(time.monotonic()),
                )
            self.observers.upstream_health(ex, up.name, now_up)

    # -- commit and relay -------------------------------------------------------------------
    async def _commit(self, send: Send, call: Call, up: Upstream, ready: Ready, watcher: Watcher) -> None:
        ex, resp = call.ex, ready.resp
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        facts = StreamFacts()
        outcome = status_outcome(resp.status)
        read_all = False
        try:
            if call.opened:
                if not fits(ready, is_sse):
                    watcher.cancel()
                    outcome, msg = await end_with_answer(send, call, up, ready)
                    self.end(ex, outcome, error=msg)
                    return
                quiet(call)  # from here on only the upstream's events: no comment between them
            call.committed = True
            call.scanner = ready.scanner
            if not call.opened:
                call.committed_sse = is_sse
                headers = response_headers(resp.raw_headers, is_sse, call.rid, up.response_policy)
                if ready.prefetched is not None:
                    headers = whole_body_headers(headers, ready.prefetched, ready.reshaped)
                elif not is_sse:
                    headers.extend(relayed_length(resp.raw_headers, resp.status))
                await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            facts, outcome = await relay_committed(send, call, ready, self.observers, outcome)
            read_all = True
        except self.attempter.errors as e:
            err = self.attempter.client.error(e)
            kind = err.kind
            if kind not in (ErrorKind.IDLE_TIMEOUT, ErrorKind.TTFT_TIMEOUT):
                kind = ErrorKind.STREAM_INTERRUPTED
            msg = say(up, err, Phase.RESPONSE, ex.upstream_url)
            if ready.scanner is not None:
                facts = ready.scanner.facts
            take_facts(ex, facts)
            if is_sse and facts.done and not facts.error_events:
                # The stream was whole (its end marker relayed): what broke is the connection after
                # it, which a client cannot tell from a clean end. Nothing appended; it went well.
                watcher.cancel()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                self.end(ex, outcome)
                return
            if not is_sse:
                # Ending a plain body early would look complete; an aborted connection does not.
                self.end(ex, outcome_of(kind), error=msg)
                return
            watcher.cancel()
            await send(
                {"type": "http.response.body", "more_body": False, "body": call.error_event(msg, kind.value)}
            )
            self.end(ex, outcome_of(kind), error=msg)
            return
        finally:
            # A fully read answer returns its connection to the pool; anything else (a failure,
            # a disconnect, a timeout) closes it, which is what stops the upstream generating.
            if read_all:
                resp.release()
            else:
                resp.close()
        take_facts(ex, facts)
        watcher.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.end(ex, outcome)
