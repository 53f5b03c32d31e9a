"""The one error table: each way an upstream request can fail, and everything that follows from it.

Pure stdlib. A kind's string is its `retries{reason}` label and its JSON error `type`; the table
says which request outcome it becomes, which status infertap answers with when it fails before
anything was sent, whether it counts against the upstream's health, and which timeout phase (if
any) it is. The core, metrics, tracing and the live view all read this table, so they cannot
drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from proxy.core.exchange import Outcome


class ErrorKind(StrEnum):
    """Why an upstream attempt (or the request around it) failed."""

    CONNECT_TIMEOUT = "connect_timeout"
    CONNECT_ERROR = "connect_error"
    TTFT_TIMEOUT = "ttft_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    # The request's own deadline ([timeouts] total), across all its attempts.
    TOTAL_TIMEOUT = "total_timeout"
    # Every connection of the upstream's pool was busy for [timeouts] pool: infertap's own queue,
    # never the upstream's fault (its circuit does not count it).
    POOL_TIMEOUT = "pool_timeout"
    STREAM_INTERRUPTED = "stream_interrupted"
    UPSTREAM_429 = "rate_limited"
    UPSTREAM_5XX = "upstream_error"
    # The upstream rejected the stream_options infertap added: asked again at once without it (a
    # retry reason only, never a request's outcome).
    STREAM_OPTIONS = "stream_options_rejected"


@dataclass(frozen=True, slots=True)
class KindInfo:
    outcome: Outcome | None  # None: never ends a request (a retry reason only)
    status: int  # infertap's answer when this ends a request before anything was relayed
    unhealthy: bool  # counts as a failure of the upstream (its circuit breaker)
    timeout_phase: str | None  # the `phase` label of infertap_timeouts_total
    # How a message says it, after "upstream 'x' (url) ": {what} is the cause in the transport's
    # words ("closed the connection"), {seconds} the timeout that ran out, {phase} where the
    # request stood (a Phase). Never an HTTP library's words: they mean nothing to a client.
    says: str = "{what} {phase}"


class Phase:
    """Where a request stood when its upstream failed, as messages say it."""

    HEADERS = "before its response headers"
    FIRST_TOKEN = "before the first token"
    RESPONSE = "mid-response"


ERRORS: dict[ErrorKind, KindInfo] = {
    ErrorKind.CONNECT_TIMEOUT: KindInfo(
        Outcome.CONNECT_TIMEOUT,
        504,
        True,
        "connect",
        "did not accept a connection within {seconds} s (connect timeout)",
    ),
    ErrorKind.CONNECT_ERROR: KindInfo(Outcome.CONNECT_ERROR, 502, True, None, "{what}"),
    ErrorKind.TTFT_TIMEOUT: KindInfo(
        Outcome.TTFT_TIMEOUT, 504, True, "ttft", "sent no token within {seconds} s (ttft timeout)"
    ),
    ErrorKind.IDLE_TIMEOUT: KindInfo(
        Outcome.IDLE_TIMEOUT, 504, True, "idle", "sent nothing for {seconds} s {phase} (idle timeout)"
    ),
    ErrorKind.TOTAL_TIMEOUT: KindInfo(
        Outcome.TOTAL_TIMEOUT,
        504,
        False,
        "total",
        "did not finish within {seconds} s {phase} (total timeout)",
    ),
    ErrorKind.POOL_TIMEOUT: KindInfo(Outcome.POOL_TIMEOUT, 503, False, "pool", "{what}"),
    ErrorKind.STREAM_INTERRUPTED: KindInfo(Outcome.STREAM_INTERRUPTED, 502, True, None),
    ErrorKind.UPSTREAM_429: KindInfo(Outcome.RATE_LIMITED, 429, False, None, "{what}"),
    ErrorKind.UPSTREAM_5XX: KindInfo(Outcome.UPSTREAM_ERROR, 502, True, None),
    ErrorKind.STREAM_OPTIONS: KindInfo(None, 400, False, None, "{what}"),
}

# By label string: retry reasons and outcomes share their strings with the kinds.
TIMEOUT_PHASES: dict[str, str] = {
    kind.value: info.timeout_phase for kind, info in ERRORS.items() if info.timeout_phase is not None
}


def outcome_of(kind: ErrorKind) -> Outcome:
    """The outcome of a request that `kind` ends."""
    outcome = ERRORS[kind].outcome
    if outcome is None:
        raise ValueError(f"{kind} never ends a request")
    return outcome


def timeout_phase(label: str) -> str | None:
    """The timeout phase of a retry reason or an outcome label, or None when it is no timeout."""
    return TIMEOUT_PHASES.get(label)


def describe(exc: BaseException) -> str:
    """A short, key-free description of infertap's own failure (a bug): the exception's type and
    message. Never for an upstream's failure: `failure_message` says those in infertap's words."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def failure_message(
    upstream: str, url: str, kind: ErrorKind, what: str, phase: str = "", seconds: float | None = None
) -> str:
    """What a client (and the access log, spans, the circuit's cause) reads when an upstream failed:
    which upstream, what it did, where the request stood and, for a timeout, how long it waited.
    `kind` is the cause (an idle timeout before the first token says `idle`, though the request
    ends as a ttft timeout)."""
    said = ERRORS[kind].says.format(what=what, phase=phase, seconds=seconds_text(seconds))
    return f"upstream '{upstream}' ({url}) {said.rstrip()}"


def seconds_text(seconds: float | None) -> str:
    """8.0 -> "8", 0.25 -> "0.25": a configured timeout as its owner wrote it."""
    return "?" if seconds is None else f"{seconds:g}"


class UpstreamError(Exception):
    """An upstream call that failed, named by the error table: what the seam
    (proxy.transport.aiohttp_client) raises for every transport failure, whatever the HTTP client.
    Its message is what the upstream did, in infertap's words, as it reads after the upstream's
    name ("closed the connection", "is unreachable: connection refused")."""

    def __init__(self, kind: ErrorKind, status: int | None, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        # The upstream's HTTP status when it sent one, else the table's answer for the kind.
        self.status = ERRORS[kind].status if status is None else status
        self.message = message

    def __str__(self) -> str:
        return self.message
