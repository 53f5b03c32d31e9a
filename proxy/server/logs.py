"""infertap's log lines: one format, set up once per process (the supervisor and each worker).

The format and its handler are proxy/observe/log_lines.py's, where the access log's direct writer
relies on them."""

from __future__ import annotations

from proxy.observe.log_lines import LOG_FORMAT, install

__all__ = ["LOG_FORMAT", "configure_logging"]


def configure_logging(level: str) -> None:
    install(level)
