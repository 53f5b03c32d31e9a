"""The access log's direct writer (proxy/observe/log_lines.py) writes what logging would have
written, and only where nothing else could see the difference."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.observe.log_lines import LineHandler, LineWriter


@contextlib.contextmanager
def alone() -> Iterator[tuple[LineHandler, io.StringIO]]:
    """The root logger as `infertap serve` leaves it: one LineHandler (here on a StringIO). Entered in
    the test's body: pytest adds a handler of its own to the root around the call, after fixtures."""
    root = logging.root
    saved, level = root.handlers[:], root.level
    handler = LineHandler()
    stream = io.StringIO()
    handler.setStream(stream)
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        yield handler, stream
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_the_timestamp_is_loggings(created: float) -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0
    assert LineWriter(logging.getLogger("x")).asctime(created) == logging.Formatter().formatTime(record)


def test_a_direct_line_is_the_line_logging_writes() -> None:
    with alone() as (handler, stream):
        _same_line(handler, stream)


def _same_line(handler: LineHandler, stream: io.StringIO) -> None:
    logger = logging.getLogger("infertap.test_log_lines")
    writer = LineWriter(logger)
    writer.write(logging.INFO, 'request_id=abc "quoted" é')
    direct = stream.getvalue()
    stream.truncate(0)
    stream.seek(0)
    logger.info('request_id=abc "quoted" é')
    through_logging = stream.getvalue()
    stamp = len("2026-01-01 00:00:00,000")
    expected = ' INFO infertap.test_log_lines: request_id=abc "quoted" é\n'
    assert direct[stamp:] == through_logging[stamp:] == expected
    assert direct[:4].isdigit() and direct[19] == ","


def test_another_handler_takes_loggings_path(caplog: pytest.LogCaptureFixture) -> None:
    with alone() as (handler, stream):
        writer = LineWriter(logging.getLogger("infertap.test_log_lines"))
        assert writer._handler(logging.INFO) is handler
        logging.root.addHandler(caplog.handler)
        try:
            assert writer._handler(logging.INFO) is None
            writer.write(logging.INFO, "seen by caplog")
        finally:
            logging.root.removeHandler(caplog.handler)
    assert "seen by caplog" in caplog.text
    assert "seen by caplog" in stream.getvalue()


def test_a_filter_or_another_formatter_takes_loggings_path() -> None:
    with alone() as (handler, stream):
        _logging_path(handler, stream)


def _logging_path(handler: LineHandler, stream: io.StringIO) -> None:
    logger = logging.getLogger("infertap.test_log_lines")
    writer = LineWriter(logger)
    assert writer._handler(logging.INFO) is handler

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return False

    # (logging applies the logger's own filters and the handler's; the writer also steps aside for a
    # parent's or the root's, which logging would not apply: harmless.)
    for owner in (logger, handler, logging.getLogger("infertap"), logging.root):
        owner.addFilter(drop := Drop())
        try:
            assert writer._handler(logging.INFO) is None
            if owner is logger or owner is handler:
                writer.write(logging.INFO, "dropped by a filter")
        finally:
            owner.removeFilter(drop)
    assert "dropped" not in stream.getvalue()
    handler.setFormatter(logging.Formatter("%(message)s"))
    assert writer._handler(logging.INFO) is None
    writer.write(logging.INFO, "formatted by the new formatter")
    assert stream.getvalue() == "formatted by the new formatter\n"


class _Writes(io.StringIO):
    """A stream that counts its writes: one per loop turn is the point of keeping lines."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


@pytest.mark.parametrize("alone_s", [3600.0, 0.0], ids=["lines come fast", "lines come alone"])
def test_fast_lines_go_in_one_write_a_loop_turn_in_order(alone_s: float) -> None:
    """The first line goes at once; those that follow it closer than `alone_s` wait for the loop's
    next turn and go in one write. Lines that come alone go at once, each."""
    with alone() as (handler, _):
        stream = _Writes()
        handler.setStream(stream)
        handler.alone_s = alone_s
        writer = LineWriter(logging.getLogger("infertap.test_log_lines"))

        async def turn() -> tuple[int, int]:
            for i in range(5):
                writer.write(logging.INFO, f"line {i}")
            written = stream.writes
            await asyncio.sleep(0)  # the loop's next turn
            await asyncio.sleep(0)
            return written, stream.writes

        at_once, in_all = asyncio.run(turn())
    assert (at_once, in_all) == ((1, 2) if alone_s else (5, 5))
    assert [line.split(": ", 1)[1] for line in stream.getvalue().splitlines()] == [
        f"line {i}" for i in range(5)
    ]


def test_a_record_through_logging_and_a_flush_write_the_kept_lines_first() -> None:
    with alone() as (handler, stream):
        handler.alone_s = 3600.0  # kept, but the first
        logger = logging.getLogger("infertap.test_log_lines")
        writer = LineWriter(logger)

        async def interleaved() -> None:
            writer.write(logging.INFO, "zeroth, at once")
            writer.write(logging.INFO, "first, kept")
            logger.warning("second, through logging")
            writer.write(logging.INFO, "third, kept")
            handler.flush()  # logging.shutdown's, at exit: nothing kept is lost
            assert stream.getvalue().count("\n") == 4

        asyncio.run(interleaved())
    assert [line.split(": ", 1)[1] for line in stream.getvalue().splitlines()] == [
        "zeroth, at once",
        "first, kept",
        "second, through logging",
        "third, kept",
    ]


def test_a_failing_stream_is_reported_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError("disk full")

    reported: list[str] = []
    with alone() as (handler, _):
        handler.setStream(Broken())
        monkeypatch.setattr(handler, "handleError", lambda record: reported.append(record.getMessage()))
        LineWriter(logging.getLogger("infertap.test_log_lines")).write(logging.INFO, "lost")
    assert len(reported) == 1 and "lost" in reported[0]


def test_lines_outside_the_loop_that_ran_before_are_written_at_once() -> None:
    """The handler remembers the loop it last kept lines for: once that loop has ended, or from
    another thread, a line cannot wait for its next turn."""
    with alone() as (handler, stream):
        handler.alone_s = 3600.0
        writer = LineWriter(logging.getLogger("infertap.test_log_lines"))

        async def kept() -> None:
            writer.write(logging.INFO, "the first, at once")
            writer.write(logging.INFO, "in the loop")

        asyncio.run(kept())
        writer.write(logging.INFO, "after it")
        assert stream.getvalue().count("\n") == 3
        lines: list[str] = []

        async def from_a_thread() -> None:
            await asyncio.to_thread(writer.write, logging.INFO, "from a thread")
            lines.extend(stream.getvalue().splitlines())

        asyncio.run(from_a_thread())
    assert [line.split(": ", 1)[1] for line in lines] == [
        "the first, at once",
        "in the loop",
        "after it",
        "from a thread",
    ]


def test_lines_kept_for_a_loop_that_stopped_are_written_by_the_next_loop() -> None:
    """Lines kept for a loop's next turn, when that loop stopped first (another thread's server, one
    that ended): the next line's loop writes them all, rather than keeping every line after them."""
    with alone() as (handler, stream):
        handler.alone_s = 3600.0
        writer = LineWriter(logging.getLogger("infertap.test_log_lines"))
        stopped = asyncio.new_event_loop()
        stopped.close()
        handler.kept = ["kept for a loop that stopped\n"]
        handler._due = stopped

        async def later() -> None:
            writer.write(logging.INFO, "a later line")
            await asyncio.sleep(0)
            await asyncio.sleep(0)

        asyncio.run(later())
    assert stream.getvalue().splitlines()[0] == "kept for a loop that stopped"
    assert stream.getvalue().splitlines()[1].endswith(": a later line")
