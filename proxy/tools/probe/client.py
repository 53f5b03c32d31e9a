"""The measuring client shared by `infertap probe` and `infertap compare`.

Requests go to a `proxy.tools.probe.target.Target`.

`measure_one` streams one chat completion with httpx and times it with `time.perf_counter()`:
TTFT is the first SSE event that carries output text (the role-only chunk does not count; the
test is the proxy's own `proxy.core.sse` scanner, so probe and proxy agree on what a token is); the
output token count comes from the usage chunk (asked for with stream_options.include_usage) or,
when the server sends none, from counting content events. `run_many` runs N requests at
concurrency C. Failures become a `Result` with an error kind and a one-line message, never an
exception (failures.py words them), and the API key never appears in any message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from proxy.core.errors import UpstreamError
from proxy.core.sse import ResponsesScanner, SSEScanner
from proxy.core.stream_facts import usage_tokens
from proxy.tools.probe.failures import (
    Failure,
    describe_exception,
    http_failure,
    status_text,
    stream_error_text,
)
from proxy.tools.probe.target import Target, ToolError

MAX_BACKOFF_S = 30.0

RETRYABLE = frozenset({"connect_error", "connect_timeout", "read_timeout", "rate_limited", "upstream_error"})


@dataclass
class Result:
    index: int
    ok: bool = False
    ttft_s: float | None = None
    total_s: float | None = None
    output_tokens: int | None = None
    token_source: str | None = None  # "usage" or "counted"
    content_events: int = 0
    prompt_tokens: int | None = None
    attempts: int = 0
    status: int | None = None
    finish_reason: str | None = None
    error_kind: str | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """The seed's formula: (total - TTFT) / max(tokens - 1, 1)."""
        if self.ttft_s is None or self.total_s is None or self.output_tokens is None:
            return None
        return (self.total_s - self.ttft_s) / max(self.output_tokens - 1, 1)

    @property
    def tps(self) -> float | None:
        tpot = self.tpot_s
        return 1.0 / tpot if tpot else None

    def as_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "ok": self.ok,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "tps": self.tps,
            "total_s": self.total_s,
            "output_tokens": self.output_tokens,
            "token_source": self.token_source,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "attempts": self.attempts,
            "status": self.status,
            "error_kind": self.error_kind,
            "error": self.error,
        }


# -- one request ------------------------------------------------------------------------------


def make_client(target: Target, concurrency: int) -> httpx.AsyncClient:
    # A pooled client: connections are reused across requests, as the seed advises.
    timeout = httpx.Timeout(
        connect=target.connect_timeout, read=target.read_timeout, write=target.read_timeout, pool=None
    )
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


def _headers(target: Target) -> dict[str, str]:
    headers = {"accept": "text/event-stream", "user-agent": "infertap-probe"}
    key = target.api_key()
    if key:
        headers["authorization"] = f"Bearer {key}"
    return headers


def _body(target: Target, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = dict(target.params)
    if target.api == "responses":  # usage always comes, in response.completed
        body.update(model=target.model, input=prompt, max_output_tokens=target.max_tokens, stream=True)
        return body
    body.update(
        model=target.model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=target.max_tokens,
        stream=True,
    )
    if target.include_usage and not target.learned.get("no_stream_options"):
        body["stream_options"] = {"include_usage": True}
    return body


async def prepare(client: httpx.AsyncClient, target: Target, *, warmup: bool = True) -> Target:
    """Before any timing: GET {base}/models, to find the model when none was given and to warm up.

    The warm-up loads the HTTP stack (httpx imports its transport lazily: ~0.1 s on first use)
    and leaves a pooled connection open, so the first timed request does not pay for the
    tool's start-up or a TCP/TLS handshake. Its errors are ignored: the timed requests report
    any real problem. Without a model and without a usable /models, ToolError.
    """
    if target.model and not warmup:
        return target
    url = target.base_url.rstrip("/") + "/models"
    try:
        resp = await client.get(url, headers=_headers(target))
    except httpx.HTTPError as e:
        if target.model:
            return target
        _, msg = describe_exception(e, url, got_headers=False)
        raise ToolError(f"no --model given and GET {url} failed: {msg}") from None
    if target.model:
        return target
    if resp.status_code != 200:
        raise ToolError(f"no --model given and GET {url} answered {status_text(resp, target)}")
    try:
        ids = [m["id"] for m in resp.json()["data"] if isinstance(m.get("id"), str)]
    except (ValueError, KeyError, TypeError, AttributeError):
        ids = []
    if not ids:
        raise ToolError(f"no --model given and GET {url} listed no model")
    return replace(target, model=ids[0])


async def measure_one(client: httpx.AsyncClient, target: Target, prompt: str, index: int = 0) -> Result:
    """Stream one chat completion (with retries before any output) and time it."""
    budget = target.max_attempts
    attempt = 0
    while True:
        attempt += 1
        result = Result(index=index, attempts=attempt)
        try:
            await _attempt(client, target, prompt, result)
            result.ok = True
            return result
        except Failure as f:
            result.error_kind, result.error, result.status = f.kind, f.message, f.status
            if f.kind == "stream_options_rejected":
                # An older server that refuses stream_options: fail open, count events instead,
                # and do not charge the retry budget for it.
                target.learned["no_stream_options"] = True
                budget += 1
                continue
            if f.kind not in RETRYABLE or result.content_events or attempt >= budget:
                return result
        delay = min(target.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
        if delay > 0:
            await asyncio.sleep(delay)


async def _attempt(client: httpx.AsyncClient, target: Target, prompt: str, result: Result) -> None:
    url = target.url
    got_headers = False
    scanner = ResponsesScanner() if target.api == "responses" else SSEScanner()
    started = time.perf_counter()
    try:
        async with client.stream("POST", url, json=_body(target, prompt), headers=_headers(target)) as resp:
            got_headers = True
            result.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                raise http_failure(resp, target)
            ctype = resp.headers.get("content-type", "")
            if "event-stream" not in ctype:
                await resp.aread()
                raise Failure(
                    "protocol_error",
                    f"{url} answered {ctype or 'without a content type'}, not an event stream "
                    "(does the server support stream: true?)",
                    resp.status_code,
                )
            done_at: float | None = None
            async for chunk in resp.aiter_bytes():
                complete, outputs = scanner.feed(chunk)
                now = time.perf_counter()
                if outputs:
                    if result.ttft_s is None:
                        result.ttft_s = now - started
                    result.content_events += outputs
                if scanner.facts.error_events:
                    raise Failure("stream_error", stream_error_text(complete), resp.status_code)
                if done_at is None and scanner.facts.done:
                    done_at = now  # the clock stops at [DONE]; the rest is only drained
            ended = done_at if done_at is not None else time.perf_counter()
    except httpx.HTTPError as e:
        kind, msg = describe_exception(e, url, got_headers, result.content_events, target.read_timeout)
        raise Failure(kind, msg, result.status) from None
    except UpstreamError as e:  # the scanner's limits: an event too large, no output for too long
        raise Failure("protocol_error", f"{url} {e.message}", result.status) from None
    facts = scanner.facts
    if result.ttft_s is None:
        raise Failure("no_output", "the stream ended without any output text", result.status)
    result.total_s = ended - started
    prompt_tokens, completion = usage_tokens(facts.usage or {})
    if isinstance(completion, int) and completion > 0:
        result.output_tokens, result.token_source = completion, "usage"
    else:
        result.output_tokens, result.token_source = result.content_events, "counted"
    result.prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else None
    result.finish_reason = facts.finish_reasons[-1] if facts.finish_reasons else None


# -- many requests ----------------------------------------------------------------------------


async def run_many(
    client: httpx.AsyncClient,
    target: Target,
    prompts: Sequence[str],
    n: int,
    concurrency: int,
    on_done: Callable[[Result], None] | None = None,
    start_index: int = 0,
) -> list[Result]:
    """N requests, at most C in flight; request i uses prompts[i % len(prompts)]."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Result:
        async with gate:
            r = await measure_one(client, target, prompts[i % len(prompts)], i)
        if on_done is not None:
            on_done(r)
        return r

    return list(await asyncio.gather(*(one(start_index + i) for i in range(n))))


class Progress:
    """`\\r12/100 done, 1 failed` on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, stream: Any, label: str = "") -> None:
        self.total, self.stream, self.label = total, stream, label
        self.done = self.failed = 0
        isatty = getattr(stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) and total > 1

    def __call__(self, r: Result) -> None:
        self.done += 1
        self.failed += not r.ok
        if self.enabled:
            tail = f", {self.failed} failed" if self.failed else ""
            self.stream.write(f"\r{self.label}{self.done}/{self.total} done{tail}  ")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()
