"""An OTLP trace receiver for tests: the real protocol (HTTP/protobuf on `/v1/traces`, and gRPC's
TraceService), decoded with the OpenTelemetry protobuf definitions, keeping every span it got.

It runs on its own threads, so the exporters of the proxy under test (in the test's own process,
on another thread) and of real vLLM servers reach it whatever the test's event loop is doing.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    events: tuple[str, ...]
    status_code: int
    start_ns: int
    end_ns: int
    resource: dict[str, Any] = field(default_factory=dict)
    # When each of `events` happened, in the same order.
    event_ns: tuple[int, ...] = ()


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class Receiver:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.exports = 0
        self._http: ThreadingHTTPServer | None = None
        self._grpc: Any = None
        self.http_url = ""
        self.grpc_url = ""

    # -- what arrived ----------------------------------------------------------------------------
    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = str(resource.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    spans.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                            events=tuple(event.name for event in span.events),
                            event_ns=tuple(event.time_unix_nano for event in span.events),
                            status_code=span.status.code,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            resource=resource,
                        )
                    )
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    # -- servers ---------------------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1") -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404 if self.path != "/v1/traces" else 415)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(raw)
                receiver.take(request)
                body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True, name="otlp-http").start()
        self.http_url = f"http://{host}:{self._http.server_address[1]}/v1/traces"

        import grpc

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (the service's name)
                receiver.take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        port = self._grpc.add_insecure_port(f"{host}:0")
        self._grpc.start()
        self.grpc_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=None)
