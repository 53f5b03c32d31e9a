"""The streaming core: parse the request, try upstreams, relay bytes, fire exactly one terminal hook.

No Prometheus and no OpenTelemetry here (lint enforces it): observers turn the Exchange into those.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson

from proxy.asgi import (
    BodyTooLarge,
    ClientGone,
    RawHeaders,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_error,
)
from proxy.exchange import Exchange, Outcome, prompt_class
from proxy.observer import ObserverSet
from proxy.sse import SSEScanner, StreamFacts, absorb_response, error_event
from proxy.upstream import RETRYABLE_STATUS, ErrorKind, RetryPolicy, Router, Upstream, classify, describe

log = logging.getLogger("infertap.forward")

# Routes whose JSON body names a model and whose streams end with `data: [DONE]`.
GENERATION_ROUTES = frozenset({"chat.completions", "completions"})
JSON_ROUTES = GENERATION_ROUTES | {"embeddings"}

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Never forwarded upstream: credentials (infertap adds the upstream's own) and what httpx sets.
_DROP_REQUEST = _HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "api-key",
    "x-api-key",
    "cookie",
    "accept-encoding",
    "x-request-id",
    "traceparent",
    "tracestate",
}
_DROP_RESPONSE = frozenset(
    h.encode() for h in _HOP_BY_HOP | {"date", "server", "x-request-id", "content-length"}
)
_MAX_REQUEST_ID = 128
_MAX_JSON_CAPTURE = 8 * 1024 * 1024

_TIMEOUT_STATUS = {
    ErrorKind.CONNECT_TIMEOUT: 504,
    ErrorKind.TTFT_TIMEOUT: 504,
    ErrorKind.IDLE_TIMEOUT: 504,
    ErrorKind.TOTAL_TIMEOUT: 504,
}
_RETRYABLE_KINDS = frozenset({ErrorKind.CONNECT_ERROR, ErrorKind.CONNECT_TIMEOUT, ErrorKind.TTFT_TIMEOUT})


def display_url(url: str) -> str:
    """The URL without user info or query: safe for logs and error messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _request_id(scope: Scope) -> str:
    given = header(scope, b"x-request-id")
    if given and len(given) <= _MAX_REQUEST_ID and given.isprintable():
        return given
    return str(uuid.uuid4())


def _prompt_chars(obj: dict[str, Any]) -> int:
    """Characters of prompt text, for the prompt size class (exact tokens come later, from usage)."""
    total = 0
    messages = obj.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, str):
                    total += len(content)
                elif isinstance(content, list):
                    for part in content:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            total += len(part["text"])
    prompt = obj.get("prompt", obj.get("input"))
    if isinstance(prompt, str):
        total += len(prompt)
    elif isinstance(prompt, list):
        total += sum(len(p) for p in prompt if isinstance(p, str))
    return total


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
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


@dataclass(slots=True)
class _Call:
    """What one proxied request needs across its attempts."""

    ex: Exchange
    upstream: Upstream
    url: str
    headers: dict[str, str]
    body: bytes
    original_body: bytes
    rid: RawHeaders


@dataclass(slots=True)
class ParsedRequest:
    body: bytes
    obj: dict[str, Any] | None


class RequestRejected(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def parse_request(route: str, body: bytes) -> ParsedRequest:
    """Validate what infertap itself must understand; everything else is the upstream's business."""
    if route not in JSON_ROUTES:
        return ParsedRequest(body, None)
    if not body.strip():
        raise RequestRejected(400, "the request body is empty: send a JSON object", "invalid_json")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestRejected(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(obj, dict):
        kind = type(obj).__name__
        raise RequestRejected(400, f"the request body must be a JSON object, got {kind}", "invalid_json")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise RequestRejected(
            400, "'model' is required and must be a non-empty string", "missing_model", "model"
        )
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestRejected(400, "'stream' must be true or false", "invalid_stream", "stream")
    return ParsedRequest(body, obj)


class Forwarder:
    def __init__(
        self,
        router: Router,
        client: httpx.AsyncClient,
        observers: ObserverSet,
        retry: RetryPolicy,
        max_body_bytes: int,
        prompt_class_bounds: tuple[int, ...] = (1024, 4096, 16384),
    ) -> None:
        self.router = router
        self.client = client
        self.observers = observers
        self.retry = retry
        self.max_body_bytes = max_body_bytes
        self.prompt_class_bounds = prompt_class_bounds
        # Upstreams that answered 400 to stream_options: infertap stops injecting it there.
        self.no_stream_options: set[str] = set()

    async def handle(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        ex = Exchange(_request_id(scope), route, scope["method"], scope["path"])
        for key, value in scope["headers"]:
            if key == b"traceparent" or key == b"tracestate":
                ex.trace_context[key.decode()] = value.decode("latin-1")
        rid = [(b"x-request-id", ex.request_id.encode())]
        try:
            body = await read_body(receive, self.max_body_bytes)
        except ClientGone:
            return
        except BodyTooLarge:
            self.observers.request_received(ex)
            msg = f"the request body is larger than the limit of {self.max_body_bytes} bytes"
            await send_error(send, 413, msg, Outcome.REJECTED, "request_too_large", rid)
            self._end(ex, Outcome.REJECTED, 413, msg)
            return
        try:
            parsed = parse_request(route, body)
        except RequestRejected as e:
            self.observers.request_received(ex)
            await send_error(send, e.status, e.message, "invalid_request_error", e.code, rid, e.param)
            self._end(ex, Outcome.REJECTED, e.status, e.message)
            return
        obj = parsed.obj
        if obj is not None:
            ex.model = obj["model"]
            ex.stream = obj.get("stream") is True
            ex.prompt_chars = _prompt_chars(obj)
            ex.prompt_class = prompt_class(ex.estimated_prompt_tokens, self.prompt_class_bounds)
            ex.params = {
                k: obj[k] for k in ("max_tokens", "max_completion_tokens", "temperature", "top_p") if k in obj
            }
        upstream = self.router.route(ex.model)
        ex.upstream = upstream.name
        ex.upstream_url = display_url(upstream.base_url)
        if obj is not None and ex.stream and route in GENERATION_ROUTES:
            body = self._maybe_inject_usage(ex, obj, upstream, body)
        self.observers.request_received(ex)
        headers = self._upstream_headers(scope, ex, upstream)
        target = upstream.url(
            scope["path"][3:]
            + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")
        )
        call = _Call(ex, upstream, target, headers, body, parsed.body, rid)
        await self._guarded(receive, send, call)

    def _maybe_inject_usage(self, ex: Exchange, obj: dict[str, Any], up: Upstream, body: bytes) -> bytes:
        opts = obj.get("stream_options")
        if isinstance(opts, dict) and "include_usage" in opts:
            return body
        if up.name in self.no_stream_options or (opts is not None and not isinstance(opts, dict)):
            return body
        ex.usage_injected = True
        new = dict(obj)
        new["stream_options"] = {**(opts or {}), "include_usage": True}
        return orjson.dumps(new)

    def _end(
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

    async def _guarded(self, receive: Receive, send: Send, call: _Call) -> None:
        """Runs the exchange while a watcher cancels it the moment the client goes away.

        The cancellation reaches whatever is awaited (connect, the wait for headers, a read),
        and leaving `client.send`'s response unread closes the upstream connection.
        """
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        ex = call.ex
        watcher = asyncio.create_task(watch())
        try:
            await self._exchange(send, call, watcher)
        except asyncio.CancelledError:
            if not gone:
                self._end(ex, Outcome.CLIENT_DISCONNECT, error="infertap is shutting down")
                raise
            task.uncancel()
            self._end(ex, Outcome.CLIENT_DISCONNECT, 499, "the client disconnected")
        except Exception as e:
            log.exception("request %s failed inside infertap", ex.request_id)
            self._end(ex, Outcome.UPSTREAM_ERROR, 500, f"internal error: {describe(e)}")
            raise
        finally:
            watcher.cancel()

    def _upstream_headers(self, scope: Scope, ex: Exchange, upstream: Upstream) -> dict[str, str]:
        headers = {}
        for k, v in scope["headers"]:
            name = k.decode("latin-1")
            if name not in _DROP_REQUEST:
                headers[name] = v.decode("latin-1")
        headers.update(upstream.headers)
        headers["accept-encoding"] = "identity"
        headers["x-request-id"] = ex.request_id
        if upstream.api_key:
            headers["authorization"] = f"Bearer {upstream.api_key}"
        return headers

    async def _backoff(self, ex: Exchange, reason: str, delay: float) -> None:
        ex.retries += 1
        self.observers.retry(ex, reason, delay)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _connect(self, send: Send, call: _Call) -> tuple[httpx.Response, bytes | None] | None:
        """Attempts until an upstream answers with headers that will be relayed.

        Returns the response (and its body when it had to be read already), or None when the
        request has been answered with an error and ended. Nothing is sent to the client before
        this returns, which is what makes retrying safe.
        """
        ex, policy, obs = call.ex, self.retry, self.observers
        attempt = 0
        while True:
            attempt += 1
            ex.attempts += 1
            ex.upstream_headers = dict(call.headers)
            ex.attempt_started_at = time.perf_counter()
            obs.attempt_started(ex)
            request = self.client.build_request(
                ex.method, call.url, headers=ex.upstream_headers, content=call.body or None
            )
            try:
                resp = await self.client.send(request, stream=True)
            except httpx.HTTPError as e:
                kind = classify(e)
                if kind is ErrorKind.IDLE_TIMEOUT:
                    kind = ErrorKind.TTFT_TIMEOUT  # no headers yet: still waiting for the first token
                if kind in _RETRYABLE_KINDS and attempt < policy.max_attempts:
                    await self._backoff(ex, kind.value, policy.backoff(attempt))
                    continue
                status = _TIMEOUT_STATUS.get(kind, 502)
                what = "did not answer in time" if status == 504 else "is unreachable"
                msg = (
                    f"upstream '{call.upstream.name}' ({ex.upstream_url}) {what} after "
                    f"{attempt} attempt(s): {describe(e)}"
                )
                await send_error(send, status, msg, kind.value, kind.value, call.rid)
                self._end(ex, Outcome(kind.value), status, msg)
                return None
            ex.status_code = resp.status_code
            ex.first_byte_at = time.perf_counter()
            obs.first_byte(ex)
            status = resp.status_code
            if status in RETRYABLE_STATUS and attempt < policy.max_attempts:
                wait = _retry_after(resp)
                delay = policy.backoff(attempt) if wait is None else min(wait, policy.max_backoff_seconds)
                await resp.aclose()
                kind = ErrorKind.UPSTREAM_429 if status == 429 else ErrorKind.UPSTREAM_5XX
                await self._backoff(ex, kind.value, delay)
                continue
            if status == 400 and ex.usage_injected:
                content = await resp.aread()
                await resp.aclose()
                if b"stream_options" not in content:
                    return resp, content
                # This upstream rejects stream_options: ask once more without it, and remember.
                self.no_stream_options.add(call.upstream.name)
                ex.usage_injected = False
                call.body = call.original_body
                attempt -= 1
                await self._backoff(ex, "stream_options_rejected", 0.0)
                continue
            return resp, None

    async def _exchange(self, send: Send, call: _Call, watcher: asyncio.Task[None]) -> None:
        ex = call.ex
        connected = await self._connect(send, call)
        if connected is None:
            return
        resp, prefetched = connected
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        headers: RawHeaders = []
        for k, v in resp.headers.raw:
            name = k.lower()
            if name in _DROP_RESPONSE or (is_sse and name == b"cache-control"):
                continue
            headers.append((name, v))
        if is_sse:
            headers.append((b"cache-control", b"no-cache"))
            headers.append((b"x-accel-buffering", b"no"))
        headers.extend(call.rid)
        facts = StreamFacts()
        outcome = _status_outcome(resp.status_code)
        try:
            await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
            if prefetched is not None:
                await send({"type": "http.response.body", "body": prefetched, "more_body": True})
            elif is_sse:
                facts = await self._relay_sse(send, ex, resp)
                if ex.route in GENERATION_ROUTES and resp.status_code == 200:
                    if facts.error_events:
                        outcome = Outcome.UPSTREAM_ERROR
                    elif not facts.done:
                        outcome = Outcome.STREAM_INTERRUPTED
                        msg = (
                            f"upstream '{ex.upstream}' ended the stream without [DONE]: "
                            "the answer is incomplete"
                        )
                        await send(
                            {
                                "type": "http.response.body",
                                "more_body": True,
                                "body": error_event(msg, outcome.value, "stream_interrupted"),
                            }
                        )
                        ex.error_message = msg
            else:
                capture = ex.route in JSON_ROUTES and "json" in resp.headers.get("content-type", "")
                facts = await self._relay_body(send, resp, capture)
        except httpx.HTTPError as e:
            kind = classify(e)
            if kind in (ErrorKind.CONNECT_ERROR, ErrorKind.PROTOCOL_ERROR):
                kind = ErrorKind.READ_ERROR
            msg = f"upstream '{ex.upstream}' failed mid-response: {describe(e)}"
            self._take_facts(ex, facts)
            if not is_sse:
                # Ending a plain body early would look complete; an aborted connection does not.
                self._end(ex, Outcome(kind.value), error=msg)
                return
            watcher.cancel()
            await send(
                {"type": "http.response.body", "more_body": False, "body": error_event(msg, kind.value)}
            )
            self._end(ex, Outcome(kind.value), error=msg)
            return
        finally:
            await resp.aclose()
        self._take_facts(ex, facts)
        watcher.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._end(ex, outcome)

    @staticmethod
    def _take_facts(ex: Exchange, facts: StreamFacts) -> None:
        usage = facts.usage
        if usage is not None:
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int):
                ex.prompt_tokens = prompt
            if isinstance(completion, int):
                ex.completion_tokens = completion
        ex.response_id = facts.response_id
        ex.response_model = facts.response_model
        ex.finish_reasons = facts.finish_reasons

    async def _relay_sse(self, send: Send, ex: Exchange, resp: httpx.Response) -> StreamFacts:
        """The hot loop: one scan, one send and, for output events, a timestamp and a hook."""
        scanner = SSEScanner(strip_usage_only=ex.usage_injected)
        obs = self.observers
        perf = time.perf_counter
        try:
            async for data in resp.aiter_raw():
                out, outputs = scanner.feed(data)
                if not out:
                    continue
                await send({"type": "http.response.body", "body": out, "more_body": True})
                if outputs:
                    now = perf()
                    if ex.first_token_at is None:
                        ex.first_token_at = ex.last_token_at = now
                        ex.output_events = 1
                        obs.first_token(ex)
                        outputs -= 1
                    while outputs:
                        gap = now - ex.last_token_at  # type: ignore[operator]
                        ex.last_token_at = now
                        ex.output_events += 1
                        obs.chunk(ex, gap)
                        outputs -= 1
        finally:
            tail = scanner.flush()
            if tail:
                await send({"type": "http.response.body", "body": tail, "more_body": True})
        return scanner.facts

    @staticmethod
    async def _relay_body(send: Send, resp: httpx.Response, capture: bool) -> StreamFacts:
        facts = StreamFacts()
        parts: list[bytes] | None = [] if capture else None
        size = 0
        async for data in resp.aiter_raw():
            await send({"type": "http.response.body", "body": data, "more_body": True})
            if parts is not None:
                size += len(data)
                if size > _MAX_JSON_CAPTURE:
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


def _status_outcome(status: int) -> Outcome:
    if status < 400:
        return Outcome.OK
    if status == 429:
        return Outcome.RATE_LIMITED
    if status < 500:
        return Outcome.CLIENT_ERROR
    return Outcome.UPSTREAM_ERROR
