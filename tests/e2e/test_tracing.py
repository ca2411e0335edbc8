"""Traces across processes (services/common/tracing.py): a deployment started with --otlp-endpoint sends
its spans to an OTLP/gRPC collector (here, one this test runs), and a disaggregated request is one
trace: the router's root span, its admission and KV hand-off spans, and the prefill and decode
workers' spans as its children, the decode steps as events. Without an endpoint nothing traces."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                    reason="tracing needs pdserve[tracing] (the OTLP exporter)")

from pdserve.services.common import tracing  # noqa: E402
from pdserve.services.client import Client  # noqa: E402
from tests.serving import start_cluster  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


class Collector:
    """tests/e2e/otlp_collector.py in its own process: every span it receives, as dicts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.otlp_collector", str(path)], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def spans(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []

    def trace_of(self, request_id: str, want: set[str], timeout: float = 30.0) -> list[dict]:
        """The spans of the trace whose root is request_id's, once spans named want have all come."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            roots = [s for s in spans if s["name"] == "pdserve.request"
                     and {"key": "request_id", "value": {"stringValue": request_id}} in s["attributes"]]
            if roots:
                trace = [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]
                if want <= {s["name"] for s in trace}:
                    return trace
            assert time.monotonic() < deadline, f"spans so far: {sorted({s['name'] for s in spans})}"
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    c = Collector(tmp_path_factory.mktemp("otlp") / "spans.jsonl")
    yield c
    c.stop()


def _attr(span: dict, key: str) -> dict:
    return next(a["value"] for a in span["attributes"] if a["key"] == key)


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
    by_name = {s["name"]: s for s in trace}
    root = by_name["pdserve.request"]
    assert root["service"] == "pdserve-router" and not root["parent_span_id"]
    assert int(_attr(root, "output_tokens")["intValue"]) == 6
    for name in ("pdserve.admission", "pdserve.kv_transfer", *workers):
        assert by_name[name]["parent_span_id"] == root["span_id"], name
    assert by_name["pdserve.worker/Prefill"]["service"] == "pdserve-prefill"
    assert by_name["pdserve.worker/Decode"]["service"] == "pdserve-decode"
    steps = by_name["pdserve.worker/Decode"]["events"]
    assert sum(int(a["value"]["intValue"]) for e in steps for a in e.get("attributes", []) if a["key"] == "tokens") == 5
    prefill_events = [e["name"] for e in by_name["pdserve.worker/Prefill"]["events"]]
    assert "first_token" in prefill_events and "kv_delivered" in prefill_events


def test_without_an_endpoint_nothing_traces() -> None:
    assert not tracing.configure("pdserve-test", None)
    assert not tracing.enabled() and tracing.start("pdserve.request") is None
    assert tracing.metadata(None) == () and tracing.server_interceptors() == []
