"""The Prometheus observer (prometheus.py, the only importer of prometheus_client), the histograms'
bucket boundaries, the bounded label sets and the event-loop lag probe."""

from proxy.observe.metrics.prometheus import Metrics

__all__ = ["Metrics"]
