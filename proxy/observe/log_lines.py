"""infertap's log lines: their one format, the handler that writes them, and a direct way to write
one that skips logging's record machinery while that handler is the only one.

The access log writes a line per request. Through `logging` each costs a `LogRecord` (about 20
attributes), a formatter pass with `%`-formatting, the handler lookups up the logger tree and the
handler's lock: about a tenth of infertap's own work on a small request. `LineWriter.write` formats
the same line itself and writes it to the handler's stream, but only while nothing could tell the
difference: the root logger's only handler is the `LineHandler` that `install` put there, with its
own formatter, and no logger on the way has a handler or filter of its own. Anything else (pytest's
caplog, a handler an embedding application added, a filter, `logging.disable`) takes the ordinary
path, so what is logged and where never changes.

Where lines come fast, those direct lines are written a loop turn's worth at a time: `LineHandler.add`
keeps them, and one `write` and one `flush` (one write(2)) at the event loop's next turn take them
all, where a line a request cost a system call each (about a tenth of a small request's CPU at 64
at once). A line that comes alone (none in the last millisecond) is written at once, as before:
kept, its write would wait for the loop's next turn, which is the next request's way in (measured
by scripts/perf/ttft_path.py: ~25 us more on a stream's way to its upstream, one at a time).
Nothing is reordered: any record that reaches the handler through logging, and any flush
(logging's shutdown at exit included), writes the kept lines first.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mypy_extensions import mypyc_attr

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# A line that comes this long after the one before is written at once.
ALONE_S = 0.001

# asctime's milliseconds, made once: formatting `:03d` for every line cost a tenth of writing it.
_MILLIS = tuple(f",{ms:03d}" for ms in range(1000))


# A class with a base that is not compiled: a plain Python class, its methods compiled
# (proxy/compiled/). Laid out natively, it crashed the interpreter in a first build.
@mypyc_attr(native_class=False)
class LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `install` gives the root logger: stderr, LOG_FORMAT."""

    def __init__(self) -> None:
        super().__init__()
        self.line_formatter = logging.Formatter(LOG_FORMAT)
        self.setFormatter(self.line_formatter)
        self.kept: list[str] = []  # LineWriter's lines, until the loop's next turn
        self._due: asyncio.AbstractEventLoop | None = None  # the loop whose next turn writes them
        self.alone_s = ALONE_S
        self._last = float("-inf")  # time.monotonic() of the last line

    def add(self, line: str) -> None:
        """Writes `line` (formatted, with its newline): at once when it comes alone or outside a
        running loop, else at the loop's next turn with the others kept by then."""
        with self.lock:  # type: ignore[union-attr]  # (created by Handler.__init__)
            kept = self.kept
            if not kept:
                now = time.monotonic()
                alone = now - self._last >= self.alone_s
                self._last = now
                if alone:
                    self._write(line, 1)
                    return
            kept.append(line)
            due = self._due
            if len(kept) > 1 and due is not None and due.is_running():
                return  # that loop's next turn writes this one too
        # The first line of a batch, or one whose batch's loop stopped before its turn (another
        # thread's, one that ended). The running loop is looked up, never kept: a loop kept may be
        # another thread's by now. (A getpid(2) in Python 3.11, once a batch.)
        loop = asyncio._get_running_loop()
        if loop is None:
            self.write_kept()
        else:
            self._due = loop
            loop.call_soon(self.write_kept)

    def write_kept(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            kept = self.kept
            if not kept:
                return
            self.kept = []
            self._due = None
            self._write(kept[0] if len(kept) == 1 else "".join(kept), len(kept))

    def _write(self, text: str, lines: int) -> None:
        try:
            stream = self.stream
            stream.write(text)
            stream.flush()
        except Exception:  # as StreamHandler.emit: a failing stream never fails a request
            record = logging.makeLogRecord({"msg": f"{lines} log line(s) lost: {text[:200]!r}"})
            self.handleError(record)

    def emit(self, record: logging.LogRecord) -> None:
        if self.kept:
            self.write_kept()
        super().emit(record)

    def flush(self) -> None:
        if self.kept:
            self.write_kept()
        super().flush()


def install(level: str) -> None:
    """Logging for one process (the supervisor, each worker): one LineHandler on the root logger."""
    logging.basicConfig(level=level.upper(), handlers=[LineHandler()])
    # LOG_FORMAT uses none of these, and each costs every record: the caller's frame, the thread,
    # the process (logging's documented optimisations).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


class LineWriter:
    """Writes `logger`'s lines as its LineHandler would, without a LogRecord, where it may."""

    __slots__ = ("logger", "_second", "_stamp")

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._second = -1
        self._stamp = ""

    def _handler(self, level: int) -> LineHandler | None:
        """The only handler a line of `logger` at `level` would reach, when it is a plain LineHandler."""
        root = logging.root
        handlers = root.handlers
        if len(handlers) != 1 or root.filters:
            return None
        handler = handlers[0]
        if type(handler) is not LineHandler or handler.formatter is not handler.line_formatter:
            return None
        if handler.filters or level < handler.level:
            return None
        logger: logging.Logger | None = self.logger
        while logger is not None and logger is not root:
            if logger.handlers or logger.filters or not logger.propagate:
                return None
            logger = logger.parent
        return handler

    def asctime(self, created: float) -> str:
        """logging.Formatter's default `%(asctime)s` for `created` (local time, milliseconds)."""
        second = int(created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
        return self._stamp + _MILLIS[int((created - second) * 1000)]

    def write(self, level: int, message: str) -> None:
        """Logs `message` at `level` (enabled: the caller checked isEnabledFor)."""
        handler = self._handler(level)
        if handler is None:
            self.logger.log(level, message)
            return
        stamp = self.asctime(time.time())
        handler.add(f"{stamp} {logging.getLevelName(level)} {self.logger.name}: {message}\n")
