"""tests/e2e/otlp_collector.py's receiver behind mutual TLS, run as its own process by
tests/services/common/test_tracing_tls.py: ``HOST CERT KEY CA FILE``; prints its port, then appends every
span it is sent to FILE as one JSON line, until killed or after MAX_RUN_S."""
from __future__ import annotations

import sys
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from tests.e2e.otlp_collector import MAX_RUN_S, Collector


def main() -> None:
    host, cert, key, ca, out = sys.argv[1:6]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(out), server)
    creds = grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())],
                                        root_certificates=Path(ca).read_bytes(), require_client_auth=True)
    port = server.add_secure_port(f"{host}:0", creds)
    server.start()
    print(port, flush=True)
    server.wait_for_termination(MAX_RUN_S)


if __name__ == "__main__":
    main()
