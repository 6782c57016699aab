"""A real OTLP/gRPC receiver on 127.0.0.1 for tests: what the mesh's exporters
send (traces and metrics), decoded into plain records to assert on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(any_value: common_pb2.AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


@dataclass
class Received:
    spans: list[Span] = field(default_factory=list)
    # (service, metric name, data points as (attributes, value)) in arrival order
    points: list[tuple[str, str, dict[str, Any], float]] = field(default_factory=list)
    # A histogram's bucket bounds, by (service, metric name): the last seen
    bounds: dict[tuple[str, str], list[float]] = field(default_factory=dict)


class OtlpReceiver(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    def __init__(self) -> None:
        self.received = Received()
        self._lock = threading.RLock()  # wait_for holds it while its predicate reads
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a process needs to export here, quickly."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_METRIC_EXPORT_INTERVAL": "300",
        }

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self._spans(request)
            return trace_service_pb2.ExportTraceServiceResponse()
        self._metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def _spans(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = _attributes(resource_spans.resource.attributes).get("service.name", "")
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.received.spans.append(
                            Span(
                                service,
                                span.name,
                                span.trace_id.hex(),
                                span.span_id.hex(),
                                span.parent_span_id.hex(),
                                _attributes(span.attributes),
                            )
                        )

    def _metrics(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self._lock:
            for resource_metrics in request.resource_metrics:
                attrs = _attributes(resource_metrics.resource.attributes)
                service = attrs.get("service.name", "")
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        data = getattr(metric, metric.WhichOneof("data"))
                        for point in data.data_points:
                            if hasattr(point, "explicit_bounds"):
                                bounds = list(point.explicit_bounds)
                                self.received.bounds[(service, metric.name)] = bounds
                            value = (
                                point.sum
                                if hasattr(point, "bucket_counts")
                                else (point.as_double or point.as_int)
                            )
                            self.received.points.append(
                                (service, metric.name, _attributes(point.attributes), value)
                            )

    def wait_for(self, done: Callable[[Received], bool], timeout_s: float = 30.0) -> Received:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if done(self.received):
                    return self.received
            if time.monotonic() > deadline:
                raise AssertionError(f"not received in {timeout_s}s: {self.received}")
            time.sleep(0.1)

    def latest(self, service: str, name: str, **attributes: Any) -> float | None:
        """The last value of a cumulative metric's point with these attributes."""
        with self._lock:
            found = [
                value
                for svc, metric, attrs, value in self.received.points
                if svc == service
                and metric == name
                and all(attrs.get(k) == v for k, v in attributes.items())
            ]
        return found[-1] if found else None
