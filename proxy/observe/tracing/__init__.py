"""The OpenTelemetry observer (spans.py, the only importer of opentelemetry) and the GenAI content
capture it records on spans when asked to."""

from proxy.observe.tracing.spans import TracingObserver, build_tracing

__all__ = ["TracingObserver", "build_tracing"]
