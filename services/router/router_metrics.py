"""The router's Prometheus metrics (pdserve.services.common.metrics: the names, the registry and the endpoint):
requests, routes, migrations, and the estimates it routes by."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from pdserve.services.common.metrics import LABELS, ProcessMetrics

if TYPE_CHECKING:
    from pdserve.services.router.placement import Placement
    from pdserve.services.router.worker_pool import WorkerHandle

THRESHOLD_OFF = -1.0    # the threshold gauge while the router does not disaggregate conditionally
UINT32_MAX = 2**32 - 1  # its cap while the worker has not said its max_model_len (as the gRPC timings')


class RouterMetrics(ProcessMetrics):
    """Request-level latency metrics, as the client sees them."""

    SHARED = {"num_requests_running": "Requests in flight through the router",
              "prompt_tokens": "Prompt tokens of finished requests",
              "generation_tokens": "Tokens streamed to clients",
              "request_queue_time_seconds": "Time queued before prefill",
              "kv_transfer_seconds": "Exposed KV transfer time per request"}

    def __init__(self, worker_id: str = "router", model_name: str = "") -> None:
        super().__init__("router", worker_id, model_name)
        self.request_success = self.counter("request_success", "Requests finished normally")
        self.request_failure = self.counter("request_failure", "Requests that ended in an error")
        self.time_to_first_token_seconds = self.histogram("time_to_first_token_seconds", "Time to first token")
        self.inter_token_latency_seconds = self.histogram("inter_token_latency_seconds", "Gap between streamed tokens")
        self.time_per_output_token_seconds = self.histogram(
            "time_per_output_token_seconds", "Per request: (e2e - TTFT) / (output tokens - 1), requests of 2+ tokens")
        self.e2e_request_latency_seconds = self.histogram("e2e_request_latency_seconds", "Request latency")
        self.migrations = self.counter("request_migrations", "Requests moved to another worker after a fault")
        self.slo_rejected = self.counter("request_slo_rejected", "Requests refused at arrival: predicted to miss "
                                         "their TTFT target (--slo-admission)")
        self.slo_shed = self.counter("request_slo_shed", "Requests shed while queued: their TTFT target passed "
                                     "(--slo-admission)")
        self.prefix_waits = self.counter("router_prefix_waits", "Requests that waited for their prefix to be computed "
                                         "or received on their worker by another request routed there before")
        self._prefill_routes = Counter("pdserve:prefill_route", "Requests by where their prompt was prefilled: "
                                       "remote (a prefill worker) or local (the decode worker)", (*LABELS, "route"),
                                       registry=self.registry)

    def count_route(self, route: str) -> None:
        self._prefill_routes.labels(**self.labels, route=route).inc()

    def attach_routing(self, placement: "Placement") -> None:
        """The estimates the router routes by, read when scraped: each worker's learned step cost
        (labelled with that worker's role and id), each decode worker's ITL inflation per locally
        prefilled token and its local-prefill threshold now (``local_prefill_threshold``), the KV
        transfer time per block and each route's overhead. Every sample is finite."""
        def worker_gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pdserve:{name}", doc, LABELS, registry=self.registry)
        base = worker_gauge("router_est_step_base_ms", "Fixed cost of one step on the worker (learned), ms")
        per_token = worker_gauge("router_est_step_ms_per_token",
                                 "Cost of one more token in a step on the worker (learned): prefill time per "
                                 "uncached token, ms")
        inflation = worker_gauge("router_est_itl_inflation_ms_per_prompt_token",
                                 "Decode workers: delay one locally prefilled prompt token adds to the steps of the "
                                 "sequences decoding there, summed over them, ms")
        per_seq = worker_gauge("router_est_decode_ms_per_seq",
                               "Cost one more decoding sequence adds to every step on the worker (learned from its "
                               "decode-only steps, else its peers'), ms")
        threshold = worker_gauge("router_local_prefill_threshold_tokens",
                                 "Decode workers (conditional disaggregation): uncached prompt tokens up to which "
                                 "prefilling on this worker is cheaper than remotely, now, capped at the worker's "
                                 "max_model_len (max_model_len: local at any length; 0: never local; -1: "
                                 "conditional disaggregation off)")
        for w in placement.pool.workers:
            labels = {"model_name": self.labels["model_name"], "role": w.role,
                      "worker": w.status.worker_id if w.status is not None and w.status.worker_id else w.address}
            base.labels(**labels).set_function(lambda w=w: placement.step_cost(w).base_ms)
            per_token.labels(**labels).set_function(lambda w=w: placement.step_cost(w).ms_per_token)
            if w.role in ("decode", "both"):
                per_seq.labels(**labels).set_function(lambda w=w: placement.step_cost(w).ms_per_seq)
            if w.role == "decode":
                inflation.labels(**labels).set_function(
                    lambda w=w: placement.load(w).running * placement.step_cost(w).ms_per_token)
                threshold.labels(**labels).set_function(lambda w=w: local_prefill_threshold(placement, w))
        self.gauge("router_est_kv_transfer_ms_per_block", "KV transfer time per block (learned from the exposed "
                   "part of each hand-off), ms").set_function(lambda: placement.costs.transfer_ms_per_block)
        self.gauge("router_est_kv_transfer_base_ms", "Fixed part of a KV hand-off's exposed time (learned), ms"
                   ).set_function(lambda: placement.costs.transfer_base_ms)
        overhead = Gauge("pdserve:router_est_route_overhead_ms", "Fixed cost of a route beyond the worker's queue and "
                         "prefill time (RPC hops; learned), ms", (*LABELS, "route"), registry=self.registry)
        for route, ewma in placement.costs.overhead_ms.items():
            overhead.labels(**self.labels, route=route).set_function(lambda e=ewma: e.value)

    def observe_tpot(self, ttft_at: float | None, finished_at: float, output_tokens: int) -> None:
        """A finished request's time per output token after the first (vLLM's TPOT)."""
        if ttft_at is not None and output_tokens > 1:
            self.time_per_output_token_seconds.observe((finished_at - ttft_at) / (output_tokens - 1))


def local_prefill_threshold(placement: "Placement", decode: "WorkerHandle") -> float:
    """The decode worker's local-prefill threshold as /metrics shows it, always finite (exporters
    such as aiperf drop NaN and infinite samples): THRESHOLD_OFF when not conditional, else the
    threshold in tokens up to the worker's max_model_len, which then means local at any length (an
    idle decode worker, or no healthy prefill worker)."""
    if not placement.conditional:
        return THRESHOLD_OFF
    status = decode.status
    longest = status.max_model_len if status is not None and status.max_model_len else UINT32_MAX
    return float(min(placement.threshold_now(decode), longest))
