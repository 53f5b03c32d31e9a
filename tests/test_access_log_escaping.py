"""A client's strings never break an access-log line (issue 24, item 18): CR, ESC, NEL, U+2028, a
bidi override or any other character that is not printable is written as an escape, in both
formats, and the JSON line still reads back as what the client sent."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.core.exchange import Exchange, Outcome
from proxy.core.route_table import route_of
from proxy.observe.access_log import _FIELDS, AccessLog, _capped, _ts, access_record
from tests.conftest import CHAT, make_settings, run_proxy, wait_until

NASTY = 'm\r\nfake=line \x1b[31mred\x1b[0m \u2028\x85\u202e\u200b\U000e0041 "q" \\ ='


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _line(fmt: str, model: str, error: str) -> str:
    logger = logging.getLogger(f"infertap.test-access.{fmt}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    lines = _Lines()
    logger.addHandler(lines)
    try:
        ex = Exchange("r1", "chat.completions", "POST", "/v1/chat/completions", model=model)
        ex.outcome, ex.error_message = Outcome.UPSTREAM_ERROR, error
        AccessLog(fmt, logger).ended(ex)
    finally:
        logger.removeHandler(lines)
    (line,) = lines.lines
    return line


@settings(max_examples=200, deadline=None)
@given(model=st.text(max_size=40), error=st.text(max_size=40))
@example(model="", error="\x7f")  # DEL, the one ASCII control character orjson leaves as it is
def test_any_client_string_stays_one_printable_line(model: str, error: str) -> None:
    for fmt in ("json", "logfmt"):
        line = _line(fmt, model, error)
        assert line.isprintable(), (fmt, line)
    record = json.loads(_line("json", model, error))
    assert record["model"] == model and record["error"] == error


@pytest.mark.parametrize("fmt", ["json", "logfmt"])
def test_a_nasty_model_name_through_a_real_proxy(
    fake: tuple[object, str], fmt: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the logfmt access log did not escape CR, ESC, U+2028 or NEL."""
    _, url = fake
    settings = make_settings(("fake", url))
    settings.metrics.access_log_format = fmt
    caplog.set_level(logging.INFO, logger="infertap.access")
    with run_proxy(settings) as proxy:
        httpx.post(
            f"{proxy}/v1/chat/completions", json={**CHAT, "model": NASTY}, headers={"x-request-id": "n1"}
        )
        wait_until(lambda: any("n1" in r.getMessage() for r in caplog.records), what="the access-log line")
    (line,) = [r.getMessage() for r in caplog.records if "n1" in r.getMessage()]
    assert line.isprintable() and "\x1b" not in line and "\u2028" not in line, line
    if fmt == "json":
        assert json.loads(line)["model"] == NASTY
    else:
        assert "\\r\\nfake=line" in line


def test_a_huge_model_name_makes_no_huge_log_line() -> None:
    """Found in review: /metrics was bounded (issue 23, item 2) but a 2 MB model name still made a
    2 MB access-log line."""
    for fmt in ("json", "logfmt"):
        line = _line(fmt, "m" * 2_000_000, "x")
        assert len(line) < 2_000 and "(2000000 characters)" in line, (fmt, len(line))


_TIME = st.none() | st.floats(min_value=0, max_value=1e4, allow_nan=False)
_COUNT = st.none() | st.integers(min_value=0, max_value=10**6)


@settings(max_examples=300, deadline=None)
@given(
    route=st.sampled_from(["chat.completions", "completions", "embeddings", "responses", "other"]),
    times=st.tuples(_TIME, _TIME, _TIME, _TIME, _TIME),
    prompt=_COUNT,
    completion=_COUNT,
    events=st.integers(min_value=0, max_value=1000),
    cost=st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False),
    model=st.none() | st.text(max_size=300),
    ns=st.integers(min_value=0, max_value=4 * 10**18),
)
def test_each_field_is_the_exchanges_own(
    route: str,
    times: tuple[float | None, ...],
    prompt: int | None,
    completion: int | None,
    events: int,
    cost: float | None,
    model: str | None,
    ns: int,
) -> None:
    """access_record writes the Exchange's properties out for speed: each field is still what the
    property (and the metrics that read it) says, rounded to the microsecond."""
    ex = Exchange("r1", route, "POST", "/v1/x", model=model, started_unix_ns=ns)
    ex.received_at = 0.0
    ex.first_token_at, ex.first_answer_at, ex.first_byte_at, ex.finished_at, ex.last_token_at = times
    ex.prompt_tokens, ex.completion_tokens, ex.output_events, ex.cost = prompt, completion, events, cost
    record = access_record(ex)

    def r(v: float | None) -> float | None:
        return None if v is None else round(v * 1e6) / 1e6

    assert record["ts"] == _ts(ns)
    assert record["model"] == _capped(model)
    assert (record["ttft_s"], record["ttft_answer_s"], record["ttfb_s"]) == (
        r(ex.ttft),
        r(ex.ttft_answer),
        r(ex.ttfb),
    )
    assert (record["tpot_s"], record["duration_s"]) == (r(ex.tpot), r(ex.duration))
    assert record["completion_tokens"] == (ex.output_tokens if route_of(route).generation else None)
    assert record["tokens_source"] == ex.token_source.value
    assert record["cost"] == (None if cost is None else round(cost, 9))
    assert list(record) == list(_FIELDS)
