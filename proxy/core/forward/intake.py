"""What infertap must understand of a request and of an upstream's answer, and nothing more."""

from __future__ import annotations

import email.utils
import itertools
import time
import uuid
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import orjson

from proxy.core.asgi import Scope, header
from proxy.core.exchange import Exchange, prompt_class
from proxy.core.route_table import Route

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
# Never forwarded upstream: credentials (infertap adds the upstream's own) and what the HTTP client sets.
# traceparent/tracestate pass through, so an engine's traces join the caller's even with tracing
# off; the tracing observer replaces them with its attempt span's context.
DROP_REQUEST = _HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "api-key",
    "x-api-key",
    "cookie",
    "accept-encoding",
    "x-request-id",
}
DROP_RESPONSE = frozenset(
    h.encode() for h in _HOP_BY_HOP | {"date", "server", "x-request-id", "content-length"}
)
MAX_REQUEST_ID = 128
MAX_JSON_CAPTURE = 8 * 1024 * 1024


class PathRejected(Exception):
    """A passthrough path that could leave the upstream's base path."""


def passthrough_suffix(scope: Scope) -> str:
    """The path after `/v1` of a passthrough request, as the client sent it (percent-encoding kept,
    so a `%2F` inside a model id stays one path segment upstream).

    Raises PathRejected for a path with a `.` or `..` segment, plain or percent-encoded (also
    behind `\\`, which some servers treat as `/`): once normalized, by the HTTP client or by
    the upstream, it could leave the upstream's base path with the upstream's key attached.
    """
    raw: bytes | None = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else scope["path"]
    if not path.startswith("/v1/"):
        raise PathRejected("the path must start with /v1/ as sent, not percent-encoded")
    suffix = path[3:]
    # A dot segment needs "/." once decoded: only a path with "/.", "%" or "\\" needs the slow look.
    if "/." in suffix or "%" in suffix or "\\" in suffix:
        decoded = suffix
        for _ in range(3):  # double (and triple) encoding: a server that decodes twice sees this
            decoded = unquote(decoded, "latin-1").replace("\\", "/")
            if any(seg in (".", "..") for seg in decoded.split("/")):
                raise PathRejected("the path has a '.' or '..' segment (plain or percent-encoded)")
            if "%" not in decoded:
                break
    return suffix


def forwarded_headers(scope: Scope) -> dict[str, str]:
    """The client's headers as they go upstream: no credentials, no hop-by-hop headers (also none
    that the client names in `Connection`), and X-Forwarded-For with the client's address appended."""
    headers: dict[str, str] = {}
    hop: list[str] = []
    forwarded_for: list[str] = []
    for k, v in scope["headers"]:
        name = k.decode("latin-1")
        if name in DROP_REQUEST:
            if name == "connection":
                hop.extend(t.strip().lower() for t in v.decode("latin-1").split(","))
        elif name == "x-forwarded-for":
            forwarded_for.append(v.decode("latin-1"))
        else:
            headers[name] = v.decode("latin-1")
    if hop:
        for name in hop:
            headers.pop(name, None)
        if "x-forwarded-for" in hop:
            forwarded_for.clear()
    client = scope.get("client")
    if client:
        forwarded_for.append(str(client[0]))
    if forwarded_for:
        headers["x-forwarded-for"] = ", ".join(forwarded_for)
    return headers


def display_url(url: str) -> str:
    """The URL without user info or query: safe for logs and error messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class RequestIds:
    """UUID-shaped request ids: a random per-process prefix and a counter.

    Unique across processes (the prefix) and within one (the counter), and an order of magnitude
    cheaper than uuid4() per request. UUID-shaped because some engines (llama-cpp-python's
    server) reject an X-Request-Id that does not parse as a UUID.
    """

    def __init__(self) -> None:
        prefix = uuid.uuid4().hex
        self._prefix = f"{prefix[:8]}-{prefix[8:12]}-4{prefix[13:16]}-{prefix[16:20]}-"
        self._next = itertools.count(int(prefix[20:], 16) & 0xFFFFFFFF).__next__

    def __call__(self, scope: Scope) -> str:
        given = header(scope, b"x-request-id")
        if given and len(given) <= MAX_REQUEST_ID and given.isprintable():
            return given
        return f"{self._prefix}{self._next() & 0xFFFFFFFFFFFF:012x}"


def prompt_chars(obj: dict[str, Any]) -> int:
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
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        # Responses API input items: {"role": ..., "content": str | [{"type": "input_text", "text": ...}]}
        total += prompt_chars({"messages": prompt})
    elif isinstance(prompt, list):
        total += sum(len(p) for p in prompt if isinstance(p, str))
    instructions = obj.get("instructions")
    if isinstance(instructions, str):
        total += len(instructions)
    return total


def fill_record(ex: Exchange, obj: dict[str, Any], bounds: tuple[int, ...]) -> None:
    """The request record's fields that come from a parsed JSON body."""
    ex.request_json = obj
    ex.model = obj["model"]
    ex.stream = obj.get("stream") is True
    ex.prompt_chars = prompt_chars(obj)
    ex.prompt_class = prompt_class(ex.estimated_prompt_tokens, bounds)
    ex.params = {k: obj[k] for k in _PARAMS if k in obj}


_PARAMS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "temperature", "top_p")


def with_usage(ex: Exchange, obj: dict[str, Any], body: bytes, upstream_rejects_it: bool) -> bytes:
    """The body with `stream_options.include_usage` added, so that a stream reports its token
    usage; unchanged when the client decided itself, or the upstream rejects stream_options."""
    opts = obj.get("stream_options")
    if isinstance(opts, dict) and "include_usage" in opts:
        return body
    if upstream_rejects_it or (opts is not None and not isinstance(opts, dict)):
        return body
    ex.usage_injected = True
    return orjson.dumps({**obj, "stream_options": {**(opts or {}), "include_usage": True}})


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


class RequestRejected(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def parse_request(route: Route, body: bytes) -> dict[str, Any] | None:
    """Validate what infertap itself must understand; everything else is the upstream's business.
    The parsed body of a JSON route; None for a route whose body infertap does not read."""
    if not route.json_body:
        return None
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
    return obj
