"""Where spans go and how: the OTLP exporter from `[tracing]` and the standard OTEL_* variables (which
win), the service resource, the sampler."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, OTELResourceDetector, Resource
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased

from proxy import __version__
from proxy.settings import ConfigError, TracingSettings

log = logging.getLogger("infertap.tracing")

PROTOCOLS = ("http/protobuf", "grpc")


@dataclass(frozen=True, slots=True)
class ExportConfig:
    endpoint: str  # the full traces URL for http/protobuf; host:port URL for grpc
    protocol: str


def export_config(ts: TracingSettings, environ: Mapping[str, str] = os.environ) -> ExportConfig | None:
    """Where spans go, or None when tracing is off. The standard OTEL_* variables win.

    `[tracing] endpoint` is a base URL like OTEL_EXPORTER_OTLP_ENDPOINT (`/v1/traces` is added
    for http/protobuf unless it is there already). OTEL_SDK_DISABLED=true or
    OTEL_TRACES_EXPORTER=none turn tracing off.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    signal = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base = (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or ts.endpoint or "").strip()
    if not signal and not base:
        return None
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip()
        or ts.protocol
    )
    if protocol not in PROTOCOLS:
        raise ConfigError(f"OTLP protocol {protocol!r} is not supported: use one of {', '.join(PROTOCOLS)}")
    if signal:
        return ExportConfig(signal, protocol)
    if protocol == "http/protobuf" and not base.rstrip("/").endswith("/v1/traces"):
        base = base.rstrip("/") + "/v1/traces"
    return ExportConfig(base, protocol)


def exporter(cfg: ExportConfig) -> SpanExporter:
    if cfg.protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise ConfigError(
                "OTLP over gRPC needs the package opentelemetry-exporter-otlp-proto-grpc "
                "(pip install 'infertap[grpc]'), or use protocol http/protobuf"
            ) from None
        return GrpcExporter(endpoint=cfg.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=cfg.endpoint)


def service_resource(ts: TracingSettings) -> Resource:
    # Resource.create() lets our attributes win over OTEL_RESOURCE_ATTRIBUTES; merging the
    # environment's once more makes it win, as everywhere else.
    ours = Resource.create({SERVICE_NAME: ts.service_name, SERVICE_VERSION: __version__})
    return ours.merge(OTELResourceDetector().detect())


def default_sampler(ts: TracingSettings, environ: Mapping[str, str] = os.environ) -> Sampler | None:
    """The sample ratio, parent-based; None where OTEL_TRACES_SAMPLER names the SDK's. Its children
    of a local parent follow the parent (ParentBased's default delegates): the tracing observer's
    attempt spans count on that (`SpanRecorder(children_follow_parent=True)`)."""
    if environ.get("OTEL_TRACES_SAMPLER", "").strip():
        return None  # the SDK reads OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG itself
    return ParentBased(TraceIdRatioBased(ts.sample_ratio))
