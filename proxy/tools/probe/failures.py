"""What went wrong with a probe request, in words: the error kind a `Result` carries and a
one-line message that says where and, where it can, what to do. The API key never appears.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx
import orjson

from proxy.core.sse import event_data
from proxy.tools.probe.target import DEFAULT_KEY_ENV, Target


class Failure(Exception):
    """A failed attempt: its error kind (see Result.error_kind), message and HTTP status."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status


def stream_error_text(events: bytes) -> str:
    for raw in events.split(b"\n\n"):
        if b'"error"' not in raw:
            continue
        try:
            obj = orjson.loads(event_data(raw))
        except orjson.JSONDecodeError:
            continue
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return f"the server sent an error event mid-stream: {err['message']}"
    return "the server sent an error event mid-stream"


def status_text(resp: httpx.Response, target: Target) -> str:
    message = ""
    try:
        err = resp.json().get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or "")
        elif isinstance(err, str):
            message = err
    except (ValueError, AttributeError):
        message = resp.text[:200].strip()
    text = f"HTTP {resp.status_code}"
    if message:
        text += f": {message[:300]}"
    if resp.status_code in (401, 403):
        env = target.api_key_env or DEFAULT_KEY_ENV
        state = "is set but was refused" if target.api_key() else "is not set"
        text += f" (the API key comes from ${env}, which {state}; see --api-key-env)"
    elif resp.status_code == 404:
        text += " (is the base URL right? OpenAI-compatible servers usually want it to end in /v1)"
    return text


def http_failure(resp: httpx.Response, target: Target) -> Failure:
    code = resp.status_code
    text = f"{target.url} answered {status_text(resp, target)}"
    asked = target.include_usage and not target.learned.get("no_stream_options")
    if code == 400 and asked and b"stream_options" in resp.content:
        return Failure("stream_options_rejected", text, code)
    if code in (401, 403):
        kind = "auth_error"
    elif code == 429:
        kind = "rate_limited"
    elif code >= 500:
        kind = "upstream_error"
    else:
        kind = "client_error"
    return Failure(kind, text, code)


def describe_exception(
    e: httpx.HTTPError,
    url: str,
    got_headers: bool,
    content_events: int = 0,
    read_timeout: float | None = None,
) -> tuple[str, str]:
    where = urlsplit(url).netloc
    if isinstance(e, httpx.ConnectTimeout):
        return "connect_timeout", f"connecting to {where} timed out"
    if isinstance(e, httpx.ConnectError):
        reason = str(e) or type(e).__name__
        if _caused_by(e, ConnectionRefusedError) or "refused" in reason.lower():
            reason = "connection refused: is the server running?"
        elif _caused_by(e, socket.gaierror) or "name or service not known" in reason.lower():
            # The seed's settings.json names taotoken.net: offline, say how to measure locally.
            reason += "; offline? --base-url http://127.0.0.1:8080/v1 measures infertap on this machine"
        return "connect_error", f"cannot connect to {where} ({reason})"
    if isinstance(e, httpx.ReadTimeout):
        limit = f" within the read timeout ({read_timeout:g} s)" if read_timeout else ""
        if not got_headers:
            return "read_timeout", f"{where} sent no response{limit}"
        if not content_events:
            return "ttft_timeout", f"{where} sent no output text{limit}"
        return "idle_timeout", f"{where} went silent mid-stream after {content_events} content events{limit}"
    if isinstance(e, httpx.TimeoutException):
        return "timeout", f"{where}: {type(e).__name__}"
    if isinstance(e, httpx.RemoteProtocolError | httpx.ReadError):
        if content_events:
            return "stream_interrupted", f"{where} closed the stream after {content_events} content events"
        if got_headers:
            return "stream_interrupted", f"{where} closed the stream before any output"
        return "connect_error", f"{where} closed the connection ({type(e).__name__})"
    return "protocol_error", f"{where}: {type(e).__name__}: {e}"


def _caused_by(e: BaseException, kind: type[BaseException]) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kind):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False
