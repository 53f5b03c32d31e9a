"""The access log: one structured line per finished request, never prompt text, never a key."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from proxy.core.exchange import Exchange
from proxy.core.hooks import Observer
from proxy.core.route_table import route_of

log = logging.getLogger("infertap.access")


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def access_record(ex: Exchange) -> dict[str, Any]:
    """The line's fields, straight from the Exchange, so they equal what the metrics observed."""
    return {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ex.started_unix_ns / 1e9))
        + f".{ex.started_unix_ns // 1_000_000 % 1000:03d}Z",
        "request_id": ex.request_id,
        "method": ex.method,
        "route": ex.route,
        "model": ex.model,
        "upstream": ex.upstream,
        "stream": ex.stream,
        "status": ex.status_code,
        "outcome": ex.outcome.value if ex.outcome is not None else None,
        "client": ex.client,
        "ttft_s": _r(ex.ttft),
        "ttft_answer_s": _r(ex.ttft_answer),
        "ttfb_s": _r(ex.ttfb),
        "tpot_s": _r(ex.tpot),
        "duration_s": _r(ex.duration),
        "prompt_tokens": ex.prompt_tokens,
        "completion_tokens": ex.output_tokens if route_of(ex.route).generation else None,
        "tokens_source": ex.token_source.value,
        "cached_tokens": ex.cached_tokens,
        "reasoning_tokens": ex.reasoning_tokens,
        "cost": None if ex.cost is None else round(ex.cost, 9),
        "output_events": ex.output_events,
        "attempts": ex.attempts,
        "retries": ex.retries,
        "trace_id": ex.trace_id,
        "error": ex.error_message,
    }


def _logfmt_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    text = str(v)
    if not text or any(c in text for c in ' "=\\') or not text.isprintable():
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class AccessLog(Observer):
    name = "access_log"

    def __init__(self, fmt: str = "json", logger: logging.Logger = log) -> None:
        self.fmt = fmt
        self.logger = logger

    def ended(self, ex: Exchange) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        record = access_record(ex)
        if self.fmt == "json":
            line = orjson.dumps(record).decode()
        else:
            line = " ".join(f"{k}={_logfmt_value(v)}" for k, v in record.items() if v is not None)
        self.logger.info(line)
