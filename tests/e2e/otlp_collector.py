"""An OTLP/gRPC trace receiver on loopback, run as its own process by tests/e2e/test_tracing.py
(a gRPC server's threads stay out of the test process, which forks elsewhere): prints its port,
then appends every span it is sent to FILE as one JSON line (service, name, ids, attributes,
events), until killed or after MAX_RUN_S."""
from __future__ import annotations

import json
import sys
from concurrent import futures

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

MAX_RUN_S = 600.0


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, path: str) -> None:
        self.out = open(path, "a", buffering=1)

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes
                           if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.out.write(json.dumps({"service": service, "name": span.name,
                                               "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                                               "parent_span_id": span.parent_span_id.hex(),
                                               "attributes": MessageToDict(span)["attributes"]
                                               if span.attributes else [],
                                               "events": [MessageToDict(e) for e in span.events]}) + "\n")
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(sys.argv[1]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination(MAX_RUN_S)


if __name__ == "__main__":
    main()
