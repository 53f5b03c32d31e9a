"""infertap's log lines: one format, set up once per process (the supervisor and each worker)."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    # LOG_FORMAT uses none of these, and each costs every record (the access log writes one per
    # request): the caller's frame, the thread, the process (logging's documented optimisations).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
