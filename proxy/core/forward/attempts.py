"""One upstream attempt, up to the point where its answer can be committed to the client.

An attempt sends the request and turns whatever goes wrong into a closed `ErrorKind` with a
message. For a generation stream it reads on until the first output event, holding the bytes:
a stall or a failure before the first token is then still invisible to the client, so the
forwarder can retry it or fall back to another upstream.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.core.asgi import RawHeaders, deadline
from proxy.core.error_bodies import MAX_ERROR_BODY, openai_error_body
from proxy.core.errors import ERRORS, ErrorKind, Phase, UpstreamError, failure_message
from proxy.core.exchange import Exchange
from proxy.core.headers import forwarded_headers
from proxy.core.hooks import ObserverSet
from proxy.core.model_routing import RETRYABLE_STATUS, Upstream
from proxy.core.replicas import Replica
from proxy.core.route_table import Route
from proxy.core.seam import UpstreamClient, UpstreamResponse
from proxy.core.sse import MAX_EVENT_BYTES, MAX_HELD_BYTES, SSEScanner, split_comments


@dataclass(slots=True)
class Call:
    """What one proxied request needs across its attempts."""

    ex: Exchange
    route: Route
    upstream: Upstream
    suffix: str
    headers: dict[str, str]
    body: bytes
    original_body: bytes
    rid: RawHeaders
    committed: bool = False
    committed_sse: bool = False  # what was committed can carry an in-band error event
    # [server] stream_headers = "immediately": 200 and the SSE headers went out before the first
    # attempt (forward/early.py); every end from then on is in-band.
    opened: bool = False
    keep_alive: asyncio.Task[None] | None = None  # its comments, until the first output event
    # While an early stream waits for its first output event: sends the upstream's comments on.
    pass_comments: Callable[[bytes], Awaitable[None]] | None = None
    # The routed upstream and its fallbacks, fixed at intake: a reload changes new requests only.
    plan: list[Upstream] = field(default_factory=list)
    scanner: SSEScanner | None = None  # the committed stream's: what an in-band error builds on
    # The client's headers as received, for a fallback whose header policy is not the routed one's.
    client_headers: Iterable[tuple[bytes, bytes]] = ()
    client_addr: Any = None
    affinity: int | None = None  # prefix_affinity's key: the conversation (forward/intake.py)

    # Written out, where dataclass would generate it (compiled, a fraction of the generated one's
    # cost, once a request): every field set to its declared default (tests/test_compiled.py).
    def __init__(
        self,
        ex: Exchange,
        route: Route,
        upstream: Upstream,
        suffix: str,
        headers: dict[str, str],
        body: bytes,
        original_body: bytes,
        rid: RawHeaders,
    ) -> None:
        self.ex = ex
        self.route = route
        self.upstream = upstream
        self.suffix = suffix
        self.headers = headers
        self.body = body
        self.original_body = original_body
        self.rid = rid
        self.committed = False
        self.committed_sse = False
        self.opened = False
        self.keep_alive = None
        self.pass_comments = None
        self.plan = []
        self.scanner = None
        self.client_headers = ()
        self.client_addr = None
        self.affinity = None

    def error_event(self, message: str, kind: str) -> bytes:
        """The in-band error that ends this committed stream, in its route's shape."""
        return self.route.error_event(message, kind, None if self.scanner is None else self.scanner.facts)


@dataclass(slots=True)
class Ready:
    """An attempt whose answer will be relayed."""

    resp: UpstreamResponse
    chunks: AsyncIterator[bytes]
    scanner: SSEScanner | None = None
    pending: list[bytes] = field(default_factory=list)
    outputs: int = 0
    first_output_at: float | None = None  # when the bytes holding the first output event arrived
    prefetched: bytes | None = None  # the whole body, already read
    reshaped: bool = False  # `prefetched` is infertap's OpenAI-shaped rewrite of an error body

    # Written out, where dataclass would generate it (compiled, a fraction of the generated one's
    # cost, once a request): every field set to its declared default (tests/test_compiled.py).
    def __init__(
        self,
        resp: UpstreamResponse,
        chunks: AsyncIterator[bytes],
        scanner: SSEScanner | None = None,
        *,
        prefetched: bytes | None = None,
        reshaped: bool = False,
    ) -> None:
        self.resp = resp
        self.chunks = chunks
        self.scanner = scanner
        self.pending = []
        self.outputs = 0
        self.first_output_at = None
        self.prefetched = prefetched
        self.reshaped = reshaped


@dataclass(slots=True)
class Failure:
    """An attempt that failed before anything was sent to the client."""

    kind: ErrorKind
    status: int
    message: str
    wait: float | None = None


class Attempter:
    def __init__(
        self,
        client: UpstreamClient,
        observers: ObserverSet,
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_held_bytes: int = MAX_HELD_BYTES,
    ) -> None:
        self.client = client
        # [server] max_sse_event_bytes, max_sse_held_bytes: what one stream may make infertap hold.
        self.max_event_bytes = max_event_bytes
        self.max_held_bytes = max_held_bytes
        self.errors: tuple[type[BaseException], ...] = (UpstreamError, *client.errors)
        self.observers = observers
        # Upstreams that answered 400 to stream_options: infertap stops injecting it there.
        self.no_stream_options: set[str] = set()

    def headers_for(self, call: Call, up: Upstream) -> dict[str, str]:
        """The attempt's headers as observers see them: without the key (see `_keyed`)."""
        policy = up.request_policy
        if policy is call.upstream.request_policy or policy == call.upstream.request_policy:
            headers = dict(call.headers)
        else:
            headers = forwarded_headers(call.client_headers, call.client_addr, up.request_policy)
            if call.route.json_body and "content-type" not in headers:
                headers["content-type"] = "application/json"
        headers.update(up.headers)
        headers["accept-encoding"] = "identity"
        headers["x-request-id"] = call.ex.request_id
        return headers

    @staticmethod
    def _keyed(headers: dict[str, str], up: Upstream) -> dict[str, str]:
        """The headers as sent. The key joins them only here, in a copy no observer ever holds,
        so no repr() or log of the Exchange can show it."""
        if not up.api_key:
            return headers
        return {**headers, "authorization": f"Bearer {up.api_key}"}

    async def run(
        self, call: Call, up: Upstream, last: bool, replica: Replica | None = None
    ) -> Ready | Failure:
        """One upstream attempt (on `replica` of its pool), up to where its answer can be committed."""
        ex, obs = call.ex, self.observers
        ex.attempts += 1
        ex.upstream = up.name
        ex.upstream_url = where = up.display_url if replica is None else replica.display_url
        url = up.url(call.suffix) if replica is None else replica.url + call.suffix
        ex.upstream_headers = self.headers_for(call, up)
        ex.attempt_started_at = time.perf_counter()
        obs.attempt_started(ex)
        scanner_type = call.route.scanner
        generation_stream = ex.stream and scanner_type is not None
        resp: UpstreamResponse | None = None
        ready: Ready | None = None
        phase = Phase.HEADERS
        try:
            async with deadline(up.ttft_timeout if generation_stream else None):
                resp = await self.client.send(
                    ex.method,
                    url,
                    self._keyed(ex.upstream_headers, up),
                    call.body or None,
                    up.timeout,
                    up.pool,
                )
                if ex.upstream_sent_at is None:
                    ex.upstream_sent_at = resp.sent_at
                ex.status_code = status = resp.status
                ex.first_byte_at = time.perf_counter()
                obs.first_byte(ex)
                if not 200 <= status <= 599:
                    # A 101 (an upgrade nobody asked for) is handed over as the final answer; relayed,
                    # it would switch the client's connection to a protocol it never asked for.
                    raise UpstreamError(
                        ErrorKind.UPSTREAM_5XX, None, f"answered HTTP {status}, no answer to a request"
                    )
                phase = Phase.FIRST_TOKEN if generation_stream and status == 200 else Phase.RESPONSE
                if status in RETRYABLE_STATUS and not last:
                    kind = ErrorKind.UPSTREAM_429 if status == 429 else ErrorKind.UPSTREAM_5XX
                    return Failure(
                        kind,
                        status,
                        f"upstream '{up.name}' ({where}) answered HTTP {status}",
                        retry_after(resp.headers.get("retry-after")),
                    )
                if status == 400 and ex.usage_injected:
                    content = await resp.read()
                    if b"stream_options" in content:
                        # This upstream rejects stream_options: the forwarder asks again without it
                        # (a new attempt, with its own deadline), and infertap remembers.
                        self.no_stream_options.add(up.name)
                        ex.usage_injected = False
                        call.body = call.original_body
                        resp.release()
                        resp = None
                        return Failure(
                            ErrorKind.STREAM_OPTIONS,
                            400,
                            f"upstream '{up.name}' ({where}) rejects stream_options: asking again without it",
                        )
                    ready = _error_answer(resp, up, content, None)
                    return ready
                chunks = resp.chunks()
                is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
                if status >= 400 and not is_sse and ex.method != "HEAD":
                    content, more = await _read_error(chunks)
                    ready = _error_answer(resp, up, content, more)
                    return ready
                if scanner_type is None or not (generation_stream and status == 200 and is_sse):
                    ready = Ready(resp, chunks)
                    return ready
                encoding = resp.headers.get("content-encoding", "identity").lower()
                if encoding not in ("", "identity"):
                    # Asked for identity (headers_for): events it encoded cannot be read, counted,
                    # stripped of usage, or ended with an error a client could read.
                    raise UpstreamError(
                        ErrorKind.UPSTREAM_5XX,
                        None,
                        f"sent a stream with content-encoding '{encoding}' although infertap asked "
                        "for identity",
                    )
                scanner = scanner_type(
                    strip_usage_only=ex.usage_injected,
                    capture_chars=ex.capture_output_chars,
                    max_event_bytes=self.max_event_bytes,
                    max_held_bytes=self.max_held_bytes,
                )
                ready = await self._until_first_output(resp, chunks, scanner, call)
                ex.first_output_read_at = ready.first_output_at
                return ready
        except self.errors as e:  # before TimeoutError: a client's own timeouts may be TimeoutErrors too
            err = self.client.error(e)
            kind = err.kind
            if kind is ErrorKind.IDLE_TIMEOUT:
                kind = ErrorKind.TTFT_TIMEOUT  # nothing relayed yet: still waiting for the first token
            return Failure(kind, ERRORS[kind].status, say(up, err, phase, where))
        except TimeoutError:
            kind = ErrorKind.TTFT_TIMEOUT
            return Failure(kind, 504, failure_message(up.name, where, kind, "", "", up.ttft_timeout))
        finally:
            if resp is not None and ready is None:
                resp.close()  # unread: drop the connection rather than return it to the pool

    @staticmethod
    async def _until_first_output(
        resp: UpstreamResponse, chunks: AsyncIterator[bytes], scanner: SSEScanner, call: Call
    ) -> Ready:
        """Reads a generation stream until its first output event (or its end), holding the bytes
        (but the upstream's comments, in an early stream: those go on at once)."""
        ready = Ready(resp, chunks, scanner)
        perf = time.perf_counter
        async for data in chunks:
            arrived = perf()  # a few reads before the first token: infertap's overhead starts here
            out, outputs = scanner.feed(data)
            if out and not outputs and call.pass_comments is not None:
                comments, out = split_comments(out)
                if comments:
                    await call.pass_comments(comments)
            if out:
                ready.pending.append(out)
            if outputs or scanner.facts.done or scanner.facts.error_events:
                ready.outputs = outputs
                if outputs:
                    ready.first_output_at = arrived
                break
        return ready


def say(up: Upstream, err: UpstreamError, phase: str, where: str | None = None) -> str:
    """The message for `err` on `up` (its cause, where the request stood, the timeout that ran out)."""
    seconds = {
        "connect": up.timeout.connect,
        "idle": up.timeout.idle,
        "ttft": up.ttft_timeout,
        "total": up.total_timeout,
    }.get(ERRORS[err.kind].timeout_phase or "")
    return failure_message(up.name, where or up.display_url, err.kind, err.message, phase, seconds)


async def _read_error(chunks: AsyncIterator[bytes]) -> tuple[bytes, AsyncIterator[bytes] | None]:
    """An error answer's body, whole (and None), or, past MAX_ERROR_BODY, what was read and the rest."""
    parts: list[bytes] = []
    size = 0
    async for data in chunks:
        parts.append(data)
        size += len(data)
        if size > MAX_ERROR_BODY:
            return b"".join(parts), chunks
    return b"".join(parts), None


def _error_answer(
    resp: UpstreamResponse, up: Upstream, content: bytes, more: AsyncIterator[bytes] | None
) -> Ready:
    """An error answer to relay: in OpenAI's shape where the engine used another, so that the
    client's SDK shows the engine's message (an encoded or oversized body goes as it came)."""
    if more is not None:
        return Ready(resp, _Chain(content, more))
    shaped = None
    if resp.headers.get("content-encoding", "identity").lower() in ("", "identity"):
        content_type = resp.headers.get("content-type", "").lower()
        shaped = openai_error_body(resp.status, content_type, content, up.name, up.api_key)
    if shaped is None:
        return Ready(resp, _Empty(), prefetched=content)
    return Ready(resp, _Empty(), prefetched=shaped, reshaped=True)


class _Chain:
    """`first`, then what `rest` yields. An iterator class, not an async generator: mypyc compiles
    no async generator (proxy/compiled/)."""

    def __init__(self, first: bytes, rest: AsyncIterator[bytes]) -> None:
        self.first: bytes | None = first
        self.rest = rest

    def __aiter__(self) -> _Chain:
        return self

    async def __anext__(self) -> bytes:
        first = self.first
        if first is not None:
            self.first = None
            return first
        return await self.rest.__anext__()


class _Empty:
    """A body with nothing (more) to read."""

    def __aiter__(self) -> _Empty:
        return self

    async def __anext__(self) -> bytes:
        raise StopAsyncIteration


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
