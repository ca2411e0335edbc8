"""Traces across processes (services/tracing.py): a deployment started with --otlp-endpoint sends
its spans to an OTLP/gRPC collector (here, one this test runs), and a disaggregated request is one
trace: the router's root span, its admission and KV hand-off spans, and the prefill and decode
workers' spans as its children, the decode steps as events. Without an endpoint nothing traces."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                    reason="tracing needs pdserve[tracing] (the OTLP exporter)")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from services import tracing  # noqa: E402
from services.client import Client  # noqa: E402
from tests.serving import start_cluster  # noqa: E402


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver on loopback: every span it is sent, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace_of(self, request_id: str, want: set[str], timeout: float = 30.0) -> list[tuple[str, object]]:
        """The spans of the trace whose root is request_id's, once spans named want have all come."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            roots = [s for _, s in spans if s.name == "pdserve.request"
                     and any(a.key == "request_id" and a.value.string_value == request_id for a in s.attributes)]
            if roots:
                trace = [(svc, s) for svc, s in spans if s.trace_id == roots[0].trace_id]
                if want <= {s.name for _, s in trace}:
                    return trace
            assert time.monotonic() < deadline, f"spans so far: {sorted({s.name for _, s in spans})}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.server.stop(0)


def test_a_disaggregated_request_is_one_trace_across_router_prefill_and_decode(tiny_qwen3, collector) -> None:
    flag = ["--otlp-endpoint", f"127.0.0.1:{collector.port}"]
    cluster = start_cluster(tiny_qwen3, router_args=flag, worker_args=flag)
    try:
        with Client(cluster.router_address, timeout=60) as client:
            out = client.generate(list(range(1, 40)), request_id="traced-1", max_tokens=6, temperature=0.0,
                                  ignore_eos=True)
        assert len(out.token_ids) == 6
        workers = {"pdserve.worker/Reserve", "pdserve.worker/Prefill", "pdserve.worker/Decode"}
        trace = collector.trace_of("traced-1", {"pdserve.request", "pdserve.admission", "pdserve.kv_transfer",
                                                *workers})
    finally:
        cluster.stop()
    by_name = {s.name: (svc, s) for svc, s in trace}
    root_service, root = by_name["pdserve.request"]
    assert root_service == "pdserve-router" and not root.parent_span_id
    assert {a.key: a.value.int_value for a in root.attributes}["output_tokens"] == 6
    for name in ("pdserve.admission", "pdserve.kv_transfer", *workers):
        assert by_name[name][1].parent_span_id == root.span_id, name
    assert by_name["pdserve.worker/Prefill"][0] == "pdserve-prefill"
    assert by_name["pdserve.worker/Decode"][0] == "pdserve-decode"
    steps = [e for e in by_name["pdserve.worker/Decode"][1].events]
    assert sum(a.value.int_value for e in steps for a in e.attributes if a.key == "tokens") == 5   # after the first
    prefill_events = [e.name for e in by_name["pdserve.worker/Prefill"][1].events]
    assert "first_token" in prefill_events and "kv_delivered" in prefill_events


def test_without_an_endpoint_nothing_traces() -> None:
    assert not tracing.configure("pdserve-test", None)
    assert not tracing.enabled() and tracing.start("pdserve.request") is None
    assert tracing.metadata(None) == () and tracing.server_interceptors() == []
