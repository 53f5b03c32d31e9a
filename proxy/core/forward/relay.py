"""Relaying an upstream answer that has been committed to the client: the per-chunk hot path."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from typing import cast

import orjson

from proxy.core.asgi import RawHeaders, Send
from proxy.core.exchange import Exchange, Outcome
from proxy.core.forward.attempts import Call, Ready
from proxy.core.forward.intake import MAX_JSON_CAPTURE
from proxy.core.headers import HeaderPolicy, returned_headers
from proxy.core.hooks import GAPS_EVERY_S, ObserverSet
from proxy.core.seam import Piped, Sink
from proxy.core.sse import SSEScanner
from proxy.core.stream_facts import StreamFacts, absorb_response, usage_details, usage_tokens

# Streams relayed in the upstream's callback (relay_piped): a number the tests can see.
piped_streams = 0

# Set on every stream below: the upstream's own copies would be sent twice (sse-starlette sends one).
_SSE_OWN = frozenset({b"cache-control", b"x-accel-buffering"})


def response_headers(
    raw: Iterable[tuple[bytes, bytes]], is_sse: bool, rid: RawHeaders, policy: HeaderPolicy
) -> RawHeaders:
    headers = returned_headers(raw, policy)
    if is_sse:
        headers = [(k, v) for k, v in headers if k not in _SSE_OWN]
        # Tell nginx and friends not to buffer: a buffered stream has no TTFT worth the name.
        headers.append((b"cache-control", b"no-cache"))
        headers.append((b"x-accel-buffering", b"no"))
    headers.extend(rid)
    return headers


def whole_body_headers(headers: RawHeaders, body: bytes, reshaped: bool) -> RawHeaders:
    """The headers for a body infertap holds whole: its length and, where infertap rewrote it into
    an OpenAI-shaped error, JSON's content type."""
    if reshaped:
        headers = [(k, v) for k, v in headers if k != b"content-type"]
        headers.append((b"content-type", b"application/json"))
    headers.append((b"content-length", str(len(body)).encode()))
    return headers


def relayed_length(raw: Iterable[tuple[bytes, bytes]], status: int) -> RawHeaders:
    """A plain body relayed byte for byte keeps the length its upstream framed it with: the client
    learns where it ends (a body cut short then shows as such), and the head and a small body go
    out in one write, with no chunked framing after them. Only a single, plain Content-Length, on
    an answer that has a body, with no Transfer-Encoding beside it (the HTTP client framed the body
    by it, so the body relayed is exactly that long or ends in a failure, which aborts the
    connection); anything else is sent chunked."""
    if status < 200 or status in (204, 304):
        return []
    found: bytes | None = None
    for k, v in raw:
        name = k.lower()
        if name == b"content-length":
            if found is not None or not v.isdigit():
                return []
            found = v
        elif name == b"transfer-encoding":
            return []
    return [] if found is None else [(b"content-length", found)]


async def relay_committed(
    send: Send, call: Call, ready: Ready, obs: ObserverSet, outcome: Outcome
) -> tuple[StreamFacts, Outcome]:
    """Relays a committed answer after its headers: what an attempt held, then the rest. Returns
    what the stream said and the outcome (a stream without its end marker is interrupted, and
    says so in-band). A failed read raises (the forwarder names it)."""
    ex = call.ex
    if ready.prefetched is not None:
        await send({"type": "http.response.body", "body": ready.prefetched, "more_body": True})
        return StreamFacts(), outcome
    scanner = ready.scanner
    if scanner is None:
        capture = call.route.json_body and "json" in ready.resp.headers.get("content-type", "")
        return await relay_body(send, ready.chunks, capture, ex.capture_output_chars), outcome
    if ready.pending:
        await send({"type": "http.response.body", "body": b"".join(ready.pending), "more_body": True})
        if ready.outputs:
            stamp_outputs(ex, obs, ready.outputs, time.perf_counter())
    # The capabilities by name (an isinstance against a runtime-checkable Protocol costs ~5 us).
    sink = getattr(send, "__self__", None)
    resp = ready.resp
    if hasattr(sink, "push") and hasattr(resp, "pipe"):
        await relay_piped(cast(Sink, sink), cast(Piped, resp), ex, obs, scanner)
    else:
        await relay_sse(send, ex, obs, ready.chunks, scanner)
    facts = scanner.facts
    if facts.error_events:
        return facts, Outcome.UPSTREAM_ERROR
    if not facts.done:
        msg = (
            f"upstream '{ex.upstream}' ({ex.upstream_url}) ended the stream without {scanner.END}: "
            "the answer is incomplete"
        )
        outcome = Outcome.STREAM_INTERRUPTED
        event = call.error_event(msg, outcome.value)
        await send({"type": "http.response.body", "more_body": True, "body": event})
        ex.error_message = msg
    return facts, outcome


def stamp_outputs(ex: Exchange, obs: ObserverSet, outputs: int, now: float) -> None:
    """Record `outputs` output events handed to the client at `now`: the first token's hook at
    once, the later gaps kept on the record and handed over about once a second (a stream's
    token rate of hooks cost more than the rest of its per-token work)."""
    last = ex.last_token_at
    if last is None:
        ex.first_token_at = ex.last_token_at = now
        ex.output_events = 1
        ex.gaps_due = now + GAPS_EVERY_S
        obs.first_token(ex)
        outputs -= 1
        if not outputs:
            return
        last = now  # the rest came with the first
    ex.last_token_at = now
    ex.output_events += outputs
    ex.gaps.append(now - last)
    if outputs > 1:
        ex.zero_gaps += outputs - 1
    if now >= ex.gaps_due:
        obs.output_gaps(ex, now)


async def relay_sse(
    send: Send, ex: Exchange, obs: ObserverSet, chunks: AsyncIterator[bytes], scanner: SSEScanner
) -> None:
    """The hot loop: one scan, one send and, for output events, a timestamp and a hook.

    The first answer event (not reasoning) is stamped too; the events held before commit were
    stamped at one instant, so an answer among them takes that instant. Only complete events are
    sent: whatever the upstream left unterminated when it stopped stays behind in the scanner, so
    the in-band error that may follow starts on an event boundary.
    """
    perf = time.perf_counter
    facts = scanner.facts
    if facts.answered and ex.first_answer_at is None:
        ex.first_answer_at = ex.last_token_at
    async for data in chunks:
        out, outputs = scanner.feed(data)
        if not out:
            continue
        await send({"type": "http.response.body", "body": out, "more_body": True})
        if outputs:
            now = perf()
            stamp_outputs(ex, obs, outputs, now)
            if ex.first_answer_at is None and facts.answered:
                ex.first_answer_at = now


async def relay_piped(sink: Sink, resp: Piped, ex: Exchange, obs: ObserverSet, scanner: SSEScanner) -> None:
    """relay_sse's loop run in the upstream connection's receive callback, where the client side
    can take a synchronous write (the raw cycle) and the upstream's answer can be piped (the
    httptools client): no reader task to wake, no message per chunk, no awaited send.

    The client's backpressure pauses the upstream's reading and resumes it; the relay's end (the
    body whole, a failed read, the idle timeout, a scanner's limit) resolves the awaited future,
    and a disconnect, the total deadline or the drain cancel it, as they cancel relay_sse's read.
    """
    global piped_streams
    piped_streams += 1
    perf = time.perf_counter
    facts = scanner.facts
    push = sink.push
    if facts.answered and ex.first_answer_at is None:
        ex.first_answer_at = ex.last_token_at

    def on_data(data: bytes) -> None:
        # scanner.feed called as a method, not through a bound method kept aside: compiled, that is
        # a native call, and its (bytes, int) is not boxed into a tuple.
        out, outputs = scanner.feed(data)
        if not out:
            return
        push(out)
        if outputs:
            now = perf()
            last = ex.last_token_at
            if outputs == 1 and last is not None and now < ex.gaps_due:
                # stamp_outputs' usual case (one more token, no hand-over due), without its frame.
                ex.last_token_at = now
                ex.output_events += 1
                ex.gaps.append(now - last)
            else:
                stamp_outputs(ex, obs, outputs, now)
            if ex.first_answer_at is None and facts.answered:
                ex.first_answer_at = now

    done = resp.pipe(on_data)
    sink.attach(resp.pause_body, resp.resume_body)
    try:
        await done
    finally:
        resp.unpipe()
        sink.detach()


async def relay_body(
    send: Send, chunks: AsyncIterator[bytes], capture: bool, capture_chars: int = 0
) -> StreamFacts:
    """A plain body, forwarded as it comes; JSON kept (up to a cap) to read its usage at the end."""
    facts = StreamFacts(capture_chars=capture_chars)
    parts: list[bytes] | None = [] if capture else None
    size = 0
    async for data in chunks:
        await send({"type": "http.response.body", "body": data, "more_body": True})
        if parts is not None:
            size += len(data)
            if size > MAX_JSON_CAPTURE:
                parts = None
            else:
                parts.append(data)
    if parts:
        try:
            obj = orjson.loads(b"".join(parts))
        except orjson.JSONDecodeError:
            return facts
        if isinstance(obj, dict):
            absorb_response(facts, obj)
    return facts


def take_facts(ex: Exchange, facts: StreamFacts) -> None:
    usage = facts.usage
    if usage is not None:
        prompt, completion = usage_tokens(usage)
        if isinstance(prompt, int):
            ex.prompt_tokens = prompt
        if isinstance(completion, int):
            ex.completion_tokens = completion
        cached, reasoning = usage_details(usage)
        if isinstance(cached, int):
            ex.cached_tokens = cached
        if isinstance(reasoning, int):
            ex.reasoning_tokens = reasoning
    ex.response_id = facts.response_id
    ex.response_model = facts.response_model
    ex.finish_reasons = facts.finish_reasons
    if facts.capture_chars:
        ex.output_text = "".join(facts.text)


def status_outcome(status: int) -> Outcome:
    if status < 400:
        return Outcome.OK
    if status == 429:
        return Outcome.RATE_LIMITED
    if status < 500:
        return Outcome.CLIENT_ERROR
    return Outcome.UPSTREAM_ERROR
