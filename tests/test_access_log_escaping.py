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
from proxy.observe.access_log import AccessLog
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
