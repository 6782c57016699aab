"""OpenTelemetry for every mesh process: off unless configured, and free then.

Turned on by the standard environment, nothing of our own:

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
  ``..._METRICS_ENDPOINT``): traces and metrics go over OTLP/gRPC; the other
  ``OTEL_*`` variables (headers, insecure, intervals) configure the exporters.
- ``OMNI_PROMETHEUS_PORT=N``: metrics are also served for scraping at
  ``http://OMNI_PROMETHEUS_HOST:N/metrics`` (``services.mesh.environment``).

With neither, ``setup`` installs nothing, ``ENABLED`` stays False and every
instrumented place checks it first, so the hot path pays one attribute read.

One trace per request: the orchestrator starts it and carries its context to
each stage in ``Submit.trace_context`` (W3C ``traceparent``/``tracestate``), per
request, never per stream. Names follow the GenAI semantic conventions where
they fit (``gen_ai.server.time_to_first_token`` …); the rest are ``omni.*``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.propagate import extract, inject

from services.mesh import environment

logger = logging.getLogger(__name__)

ENABLED = False
_providers: list[Any] = []

_OTLP_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)
# Seconds: latencies from a millisecond to minutes.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# Real-time factors: below 1 the audio comes faster than it plays.
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.85, 1, 1.25, 1.5, 2, 3, 5, 10)


def _configured(env: Mapping[str, str]) -> tuple[bool, int | None]:
    otlp = any(env.get(name) for name in _OTLP_VARS)
    return otlp, environment.PROMETHEUS_PORT.get(env)


def setup(service: str, env: Mapping[str, str] = os.environ) -> bool:
    """Install exporters for this process if the environment asks for them."""
    global ENABLED
    otlp, prometheus_port = _configured(env)
    if not otlp and prometheus_port is None:
        return False
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({"service.name": service, "service.namespace": "omni-mesh"})
    readers: list[Any] = []
    tracer_provider = TracerProvider(resource=resource)
    if otlp:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if prometheus_port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        host = environment.PROMETHEUS_HOST.get(env)
        start_http_server(prometheus_port, addr=host)
        readers.append(PrometheusMetricReader())
        logger.info("metrics for scraping at http://%s:%d/metrics", host, prometheus_port)
    views = [
        View(
            instrument_name="*duration*",
            aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS),
        ),
        View(
            instrument_name="gen_ai.server.time_*",
            aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS),
        ),
        View(
            instrument_name="omni.audio.time_to_first_packet",
            aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS),
        ),
        View(
            instrument_name="omni.audio.real_time_factor",
            aggregation=ExplicitBucketHistogramAggregation(_RTF_BUCKETS),
        ),
    ]
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, views=views)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    _providers[:] = [tracer_provider, meter_provider]
    ENABLED = True
    logger.info("telemetry on for %s (otlp %s)", service, "on" if otlp else "off")
    return True


def shutdown() -> None:
    """Flush and stop the exporters (at process exit)."""
    global ENABLED
    for provider in _providers:
        try:
            provider.shutdown()
        except Exception:  # an exporter that cannot flush must not stop the shutdown
            logger.exception("telemetry: shutdown failed")
    _providers.clear()
    ENABLED = False


def tracer() -> trace.Tracer:
    return trace.get_tracer("omni-mesh")


def meter() -> metrics.Meter:
    return metrics.get_meter("omni-mesh")


def inject_into(carrier: MutableMapping[str, str]) -> None:
    """The current trace context into a Submit's ``trace_context`` map."""
    if ENABLED:
        inject(carrier)


@contextmanager
def context_of(carrier: Mapping[str, str]) -> Iterator[None]:
    """Run the body in the trace context a Submit carried (if any)."""
    if not ENABLED or not carrier:
        yield
        return
    token = otel_context.attach(extract(dict(carrier)))
    try:
        yield
    finally:
        otel_context.detach(token)
