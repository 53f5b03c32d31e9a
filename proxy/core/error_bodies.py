"""An upstream's error answer in OpenAI's shape, so that every client shows its message.

The SDKs read an error's message at `error.message`. Engines do not all put it there: vLLM and
SGLang answer `{"object": "error", "message": ..., "type": ..., "param": ..., "code": ...}`, TGI
`{"error": "...", "error_type": ...}`, FastAPI apps `{"detail": ...}`, and a load balancer in front
of any of them a plain-text or HTML page. The JavaScript SDKs then said "400 status code (no body)".

Only error statuses, and only bodies that are not already OpenAI-shaped (an `error` object with a
string `message`), are rewritten; every field an engine sent is kept inside `error`. Pure.
"""

from __future__ import annotations

import html
import re
from typing import Any

import orjson

# An error body longer than this is relayed as it is (none is, in practice; a stream is no error).
MAX_ERROR_BODY = 64 * 1024
# How much of a text or HTML page the message quotes.
EXCERPT_CHARS = 200

_TITLE = re.compile(rb"<title[^>]*>(.*?)</title\s*>", re.IGNORECASE | re.DOTALL)
_HIDDEN = re.compile(rb"<(script|style)\b.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(rb"<[^>]*>")
# Terminal colour codes (some servers log-format their error pages) and other control characters.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x1f\x7f-\x9f]+")


def openai_error_body(
    status: int, content_type: str, body: bytes, upstream: str, secret: str | None
) -> bytes | None:
    """The body as OpenAI's `{"error": {"message", "type", "param", "code", ...}}`, or None where it
    needs no change (not an error status, or already in that shape). `secret` (the upstream's key)
    is masked wherever it appears in what infertap writes."""
    if status < 400:
        return None
    obj = _json(content_type, body)
    if isinstance(obj, dict):
        inner = obj.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return None
        error = _from_object(obj, status, upstream, body)
    else:
        error = {"message": _said(status, upstream, _excerpt(body))}
    shaped = {
        "message": error.pop("message"),
        "type": error.pop("type", default_type(status)),
        "param": error.pop("param", None),
        "code": error.pop("code", None),
        **error,
    }
    out = orjson.dumps({"error": shaped})
    # An engine may echo the key it was sent ("invalid API key: sk-..."); a short one would match
    # ordinary text, and no real key is that short.
    if secret and len(secret) >= 8 and secret.encode() in out:
        out = out.replace(secret.encode(), b"[redacted]")
    return out


def default_type(status: int) -> str:
    """An error `type` in infertap's vocabulary (its own errors' types), for bodies that name none."""
    if status == 429:
        return "rate_limited"
    return "upstream_error" if status >= 500 else "invalid_request_error"


def _json(content_type: str, body: bytes) -> Any:
    start = body.lstrip()[:1]
    if "json" not in content_type and start not in (b"{", b"["):
        return None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _from_object(obj: dict[str, Any], status: int, upstream: str, body: bytes) -> dict[str, Any]:
    """The engine's fields, led by the four OpenAI names, the message found where the engine put it."""
    rest = dict(obj)
    message = rest.pop("message", None)
    if isinstance(message, str) and message:
        pass
    elif isinstance(rest.get("error"), str) and rest["error"]:  # TGI: {"error": "...", "error_type": ...}
        message = rest.pop("error")
        if isinstance(rest.get("error_type"), str):
            rest.setdefault("type", rest["error_type"])
    elif rest.get("detail"):  # FastAPI: {"detail": "..."} or its list of validation errors
        detail = rest["detail"]
        message = detail if isinstance(detail, str) else _excerpt(orjson.dumps(detail))
    else:
        message = _said(status, upstream, _excerpt(body))
    error: dict[str, Any] = {"message": message}
    for key in ("type", "param", "code"):
        if key in rest:
            error[key] = rest.pop(key)
    error.update(rest)
    return error


def _said(status: int, upstream: str, excerpt: str) -> str:
    what = f"upstream '{upstream}' answered HTTP {status}"
    return f"{what}: {excerpt}" if excerpt else f"{what} with an empty body"


def _excerpt(body: bytes) -> str:
    """A short, single-line, tag-free quote of a text or HTML body."""
    head = body[: 16 * EXCERPT_CHARS]
    title = _TITLE.search(head)
    if title is not None and title.group(1).strip():
        head = title.group(1)
    elif b"<" in head:
        head = _TAG.sub(b" ", _HIDDEN.sub(b" ", head))
    text = html.unescape(head.decode("utf-8", "replace"))
    text = " ".join(_CONTROL.sub(" ", text).split())
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 1].rstrip() + "…"
