"""The access log: one structured line per request, never prompt text, never a key.

A forwarded request's line comes from its Exchange; a request infertap answered itself (refused
before it was read, or one of its own routes) has the same fields, most of them null. Successful
probes and scrapes (/healthz, /readyz, /metrics, the /ui page's polling) come every few seconds:
their lines are DEBUG, so they show only with `--log-level debug`; everything else is INFO.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Final

import orjson
from mypy_extensions import mypyc_attr

from proxy.core.exchange import Exchange, LocalAnswer
from proxy.core.hooks import Observer
from proxy.core.route_table import route_of
from proxy.observe.log_lines import LineWriter

log = logging.getLogger("infertap.access")


# Answered every few seconds by design: DEBUG when they succeed.
QUIET_ROUTES = frozenset({"healthz", "readyz", "metrics", "ui"})


def _r(value: float | None) -> float | None:
    # To the microsecond: round(value, 6)'s decimal rounding costs three times as much, for the
    # same digits but in a halfway case.
    return None if value is None else round(value * 1e6) / 1e6


@functools.lru_cache(maxsize=4)  # a line per request, a strftime per second
def _utc_second(second: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


# The milliseconds' ends, made once: formatting `:03d` per line cost more than the rest of `ts`.
_MILLIS = tuple(f".{ms:03d}Z" for ms in range(1000))


def _ts(unix_ns: int) -> str:
    second, ns = divmod(unix_ns, 1_000_000_000)
    return _utc_second(second) + _MILLIS[ns // 1_000_000]


# A client's model name in a log line: enough to recognise it, never a megabyte-long line.
MAX_MODEL_CHARS = 256


def _capped(model: str | None) -> str | None:
    if model is None or len(model) <= MAX_MODEL_CHARS:
        return model
    return f"{model[:MAX_MODEL_CHARS]}... ({len(model)} characters)"


# The line's fields, in their order.
_FIELDS: Final = (
    "ts",
    "request_id",
    "method",
    "route",
    "model",
    "upstream",
    "stream",
    "status",
    "outcome",
    "client",
    "ttft_s",
    "ttft_answer_s",
    "ttfb_s",
    "tpot_s",
    "duration_s",
    "prompt_tokens",
    "completion_tokens",
    "tokens_source",
    "cached_tokens",
    "reasoning_tokens",
    "cost",
    "output_events",
    "attempts",
    "retries",
    "trace_id",
    "error",
)
_TEMPLATE: Final[dict[str, Any]] = dict.fromkeys(_FIELDS)


def access_record(ex: Exchange) -> dict[str, Any]:
    """The line's fields, straight from the Exchange, so they equal what the metrics observed.

    Exchange's properties (ttft, ttfb, tpot, duration...) and `_r` are written out here: their
    calls were a third of the line's cost, and the line is written for every request
    (tests/test_access_log_escaping.py holds each field to the property it stands for)."""
    t0 = ex.received_at
    first = ex.first_token_at
    answer = ex.first_answer_at
    byte = ex.first_byte_at
    end = ex.finished_at
    last = ex.last_token_at
    completion = ex.completion_tokens
    tokens = completion if completion is not None else ex.output_events
    tpot = None
    if first is not None and last is not None and tokens >= 2:
        tpot = round((last - first) / (tokens - 1) * 1e6) / 1e6
    # A timestamp in ns fits a native int (until 2116): `//` and `%` where divmod was a generic call.
    unix_ns = ex.started_unix_ns
    second = unix_ns // 1_000_000_000
    ns = unix_ns % 1_000_000_000
    model = ex.model
    outcome = ex.outcome
    route = ex.route
    cost = ex.cost
    # Filled into a copy of the fields' template, where a dict display inserted each of the 26 keys
    # anew: 12.7k -> 11.5k instructions for the record.
    record = _TEMPLATE.copy()
    record["ts"] = _utc_second(second) + _MILLIS[ns // 1_000_000]
    record["request_id"] = ex.request_id
    record["method"] = ex.method
    record["route"] = route
    record["model"] = model if model is None or len(model) <= MAX_MODEL_CHARS else _capped(model)
    record["upstream"] = ex.upstream
    record["stream"] = ex.stream
    record["status"] = ex.status_code
    # _value_, not Enum's `value` property (several times slower; a line per request).
    record["outcome"] = outcome._value_ if outcome is not None else None
    record["client"] = ex.client
    # To the microsecond, as _r.
    record["ttft_s"] = None if first is None else round((first - t0) * 1e6) / 1e6
    record["ttft_answer_s"] = None if answer is None else round((answer - t0) * 1e6) / 1e6
    record["ttfb_s"] = None if byte is None else round((byte - t0) * 1e6) / 1e6
    record["tpot_s"] = tpot
    record["duration_s"] = None if end is None else round((end - t0) * 1e6) / 1e6
    record["prompt_tokens"] = ex.prompt_tokens
    record["completion_tokens"] = tokens if route_of(route).generation else None
    # Embeddings produce no completion: their usage holds the prompt tokens alone.
    usage = ex.prompt_tokens if route == "embeddings" else completion
    record["tokens_source"] = "usage" if usage is not None else "estimated"
    record["cached_tokens"] = ex.cached_tokens
    record["reasoning_tokens"] = ex.reasoning_tokens
    record["cost"] = None if cost is None else round(cost, 9)
    record["output_events"] = ex.output_events
    record["attempts"] = ex.attempts
    record["retries"] = ex.retries
    record["trace_id"] = ex.trace_id
    record["error"] = ex.error_message
    if ex.replica is not None:  # a pool's: the replica that answered (or was tried last)
        record["replica"] = ex.replica
    return record


def local_record(answer: LocalAnswer) -> dict[str, Any]:
    """The same fields for a request infertap answered itself: what it knows of one is its route,
    status, client (for a /v1/ request past the key check) and duration."""
    record = _TEMPLATE.copy()
    record.update(
        ts=_ts(answer.started_unix_ns),
        request_id=answer.request_id,
        method=answer.method,
        route=answer.route,
        status=answer.status,
        client=answer.client,
        duration_s=_r(answer.duration),
    )
    return record


def _logfmt_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    text = str(v)
    if text and text.isprintable() and not any(c in text for c in ' "=\\'):
        return text
    return '"' + "".join(_LOGFMT_ESCAPES.get(c) or _printable(c) for c in text) + '"'


_LOGFMT_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _printable(c: str) -> str:
    """`c`, or its escape when it is not printable (CR, ESC, NEL, U+2028, a bidi override...): a
    client's string can never start a new log line or restyle a terminal. Valid in JSON strings too."""
    if c.isprintable():
        return c
    n = ord(c)
    if n <= 0xFFFF:
        return f"\\u{n:04x}"
    n -= 0x10000
    return f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}"


def _json_line(record: dict[str, Any]) -> str:
    line = orjson.dumps(record).decode()
    # orjson escapes the ASCII control characters but DEL; DEL, NEL, U+2028 and the like it writes
    # as they are. (isascii is O(1); the scans run only where they can find something.)
    if "\x7f" in line if line.isascii() else not line.isprintable():
        line = "".join(map(_printable, line))
    return line


# Native (proxy/compiled/), and open to subclasses that are not compiled.
@mypyc_attr(allow_interpreted_subclasses=True)
class AccessLog(Observer):
    name = "access_log"

    def __init__(self, fmt: str = "json", logger: logging.Logger = log) -> None:
        self.fmt = fmt
        self.logger = logger
        self.writer = LineWriter(logger)  # the line without a LogRecord, where nobody can tell

    def ended(self, ex: Exchange) -> None:
        if self.logger.isEnabledFor(logging.INFO):
            self.writer.write(logging.INFO, self._line(access_record(ex)))

    def answered(self, answer: LocalAnswer) -> None:
        quiet = answer.route in QUIET_ROUTES and answer.status < 400
        level = logging.DEBUG if quiet else logging.INFO
        if self.logger.isEnabledFor(level):
            self.writer.write(level, self._line(local_record(answer)))

    def _line(self, record: dict[str, Any]) -> str:
        if self.fmt == "json":
            return _json_line(record)
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in record.items() if v is not None)
