"""The OpenTelemetry observer (spans.py), its export's set-up (export.py): with the GenAI content
capture, the only package that imports opentelemetry."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from proxy.observe.tracing.export import export_config, exporter
from proxy.observe.tracing.spans import TracingObserver
from proxy.settings import Settings

__all__ = ["TracingObserver", "build_tracing", "export_config"]

log = logging.getLogger("infertap.tracing")


def build_tracing(settings: Settings) -> TracingObserver | None:
    """The tracing observer for `settings` and the OTEL_* environment, or None when off."""
    cfg = export_config(settings.tracing)
    if cfg is None:
        return None
    observer = TracingObserver(settings.tracing, exporter=exporter(cfg))
    parts = urlsplit(cfg.endpoint)
    where = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path}"
    log.info("tracing: spans go to %s (%s)", where, cfg.protocol)
    return observer
