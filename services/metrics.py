"""Prometheus metrics, named like vLLM's under a `pdserve:` prefix, labelled by role and worker."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from engine import LLMEngine, RequestOutput

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LABELS = ("role", "worker")


class _Metrics:
    def __init__(self, role: str, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"role": role, "worker": worker_id}

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(f"pdserve:{name}", doc, LABELS, registry=self.registry).labels(**self.labels)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"pdserve:{name}", doc, LABELS, registry=self.registry).labels(**self.labels)

    def histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(f"pdserve:{name}", doc, LABELS, buckets=LATENCY_BUCKETS,
                         registry=self.registry).labels(**self.labels)


class WorkerMetrics(_Metrics):
    """Engine-side metrics, updated from the engine thread after every step."""

    def __init__(self, role: str, worker_id: str) -> None:
        super().__init__(role, worker_id)
        self.num_requests_running = self.gauge("num_requests_running", "Sequences in the running batch")
        self.num_requests_waiting = self.gauge("num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_cache_usage_perc = self.gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.prefix_cache_queries = self.counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = self.counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = self.counter("num_preemptions", "Sequences preempted for recompute")
        self.prompt_tokens = self.counter("prompt_tokens", "Prompt tokens of requests prefilled here")
        self.generation_tokens = self.counter("generation_tokens", "Tokens sampled here")
        self.kv_transfer_bytes = self.counter("kv_transfer_bytes", "KV bytes sent (prefill) or received (decode)")
        self.kv_transfer_seconds = self.histogram("kv_transfer_seconds", "Seconds per KV send of a chunk's blocks")
        self.kv_transfer_failures = self.counter("kv_transfer_failures", "KV blocks refused or failed to send")
        self.request_queue_time_seconds = self.histogram("request_queue_time_seconds", "Arrival to first scheduled")
        self._last = {"queries": 0, "hits": 0, "preemptions": 0}

    def on_step(self, engine: "LLMEngine", outputs: list["RequestOutput"]) -> None:
        bm, sched = engine.block_manager, engine.scheduler
        self.num_requests_running.set(len(sched.running))
        self.num_requests_waiting.set(len(sched.waiting))
        self.kv_cache_usage_perc.set(bm.usage())
        for key, counter, value in (("queries", self.prefix_cache_queries, bm.prefix_cache_queries),
                                    ("hits", self.prefix_cache_hits, bm.prefix_cache_hits),
                                    ("preemptions", self.num_preemptions, sched.num_preemptions)):
            counter.inc(value - self._last[key])
            self._last[key] = value
        for out in outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            if out.queue_s is not None:   # first token: the prompt was prefilled here
                self.prompt_tokens.inc(out.num_prompt_tokens)
                self.request_queue_time_seconds.observe(out.queue_s)

    def kv_sent(self, nbytes: int, seconds: float) -> None:
        self.kv_transfer_bytes.inc(nbytes)
        self.kv_transfer_seconds.observe(seconds)

    def kv_received(self, nbytes: int) -> None:
        self.kv_transfer_bytes.inc(nbytes)

    def kv_failure(self) -> None:
        self.kv_transfer_failures.inc()

    def kv_handoff_ended(self, state) -> None:
        """Decode role: a reservation ended; a failed or lapsed one counts as a KV failure."""
        if state.value in ("failed", "expired"):
            self.kv_transfer_failures.inc()


class RouterMetrics(_Metrics):
    """Request-level latency metrics, as the client sees them."""

    def __init__(self, worker_id: str = "router") -> None:
        super().__init__("router", worker_id)
        self.num_requests_running = self.gauge("num_requests_running", "Requests in flight through the router")
        self.prompt_tokens = self.counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = self.counter("generation_tokens", "Tokens streamed to clients")
        self.request_success = self.counter("request_success", "Requests finished normally")
        self.request_failure = self.counter("request_failure", "Requests that ended in an error")
        self.time_to_first_token_seconds = self.histogram("time_to_first_token_seconds", "Time to first token")
        self.inter_token_latency_seconds = self.histogram("inter_token_latency_seconds", "Gap between streamed tokens")
        self.e2e_request_latency_seconds = self.histogram("e2e_request_latency_seconds", "Request latency")
        self.request_queue_time_seconds = self.histogram("request_queue_time_seconds", "Time queued before prefill")
        self.kv_transfer_seconds = self.histogram("kv_transfer_seconds", "Exposed KV transfer time per request")
        self.migrations = self.counter("request_migrations", "Requests moved to another worker after a fault")


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve /metrics over HTTP; returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
