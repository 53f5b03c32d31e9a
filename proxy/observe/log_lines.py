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
"""

from __future__ import annotations

import logging
import time

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# asctime's milliseconds, made once: formatting `:03d` for every line cost a tenth of writing it.
_MILLIS = tuple(f",{ms:03d}" for ms in range(1000))


class LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `install` gives the root logger: stderr, LOG_FORMAT."""

    def __init__(self) -> None:
        super().__init__()
        self.line_formatter = logging.Formatter(LOG_FORMAT)
        self.setFormatter(self.line_formatter)


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
        line = f"{self.asctime(time.time())} {logging.getLevelName(level)} {self.logger.name}: {message}\n"
        handler.acquire()
        try:
            stream = handler.stream
            stream.write(line)
            stream.flush()
        except Exception:  # as StreamHandler.emit: a failing stream never fails the request
            handler.release()
            self.logger.log(level, message)  # let logging report it (handleError) its own way
            return
        handler.release()
