"""Prometheus metrics, named like vLLM's under a `pdserve:` prefix, labelled by model_name (as
vLLM labels its own), role and worker. Every process serves them at ``/metrics`` only (any other
path: 404). Gauges of a worker are read when scraped, so they are exact whenever the engine's state
changed, not only after an engine step (an aborted request leaves at once). A worker that switches
roles (Worker.SetRole) labels its later samples with its new role (``WorkerMetrics.set_role``).

The endpoint cannot be used to starve its process: a connection's request (line and headers) must
arrive within READ_TIMEOUT_S of its accept, however slowly its bytes come; at most MAX_CONNECTIONS
are served at once, MAX_CONNECTIONS_PER_PEER from one address (one more is closed as soon as it is
accepted, so the process's file descriptors stay bounded); and with a token
(``--metrics-token-file``) a scrape must carry ``Authorization: Bearer TOKEN`` (Prometheus:
``authorization: credentials_file``)."""
from __future__ import annotations

import hmac
import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import math
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.exposition import choose_encoder

from pdserve.engine.settings import ENV
from pdserve.services.common.security import read_secret

if TYPE_CHECKING:
    from pdserve.engine import LLMEngine, RequestOutput
    from pdserve.services.workers.async_engine import StepTime
    from pdserve.services.router.placement import Placement

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LABELS = ("model_name", "role", "worker")
METRICS_PATH = "/metrics"
READ_TIMEOUT_S = 5.0        # a request not read whole this long after its accept is dropped (and each write's bound)
MAX_CONNECTIONS = 32        # served at once; more are closed when accepted
MAX_CONNECTIONS_PER_PEER = 8   # ... of them from one address
METRICS_TOKEN_ENV = ENV.METRICS_TOKEN.name


def scrape_by_name(address: str, timeout: float = 10.0, token: str | None = None) -> dict[str, float]:
    """The samples of a /metrics endpoint at host:port, summed per metric name over labels."""
    import urllib.request
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://{address}{METRICS_PATH}", headers=headers)
    text = urllib.request.urlopen(request, timeout=timeout).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


class _Metrics:
    """The registry of one process, and the metrics every role publishes under the same names
    (as vLLM does); what each counts there is its class's ``SHARED`` help."""

    SHARED: dict[str, str] = {}

    def __init__(self, role: str, worker_id: str, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)   # process_cpu_seconds_total, memory, open fds (as vLLM)
        self.labels = {"model_name": model_name, "role": role, "worker": worker_id}
        self._families: dict[int, MetricWrapperBase] = {}   # id(child) -> its family: relabel
        doc = self.SHARED
        self.num_requests_running = self.gauge("num_requests_running", doc["num_requests_running"])
        self.prompt_tokens = self.counter("prompt_tokens", doc["prompt_tokens"])
        self.generation_tokens = self.counter("generation_tokens", doc["generation_tokens"])
        self.request_queue_time_seconds = self.histogram("request_queue_time_seconds", doc["request_queue_time_seconds"])
        self.kv_transfer_seconds = self.histogram("kv_transfer_seconds", doc["kv_transfer_seconds"])

    def counter(self, name: str, doc: str) -> Counter:
        return self._child(Counter(f"pdserve:{name}", doc, LABELS, registry=self.registry))

    def gauge(self, name: str, doc: str) -> Gauge:
        return self._child(Gauge(f"pdserve:{name}", doc, LABELS, registry=self.registry))

    def histogram(self, name: str, doc: str) -> Histogram:
        return self._child(Histogram(f"pdserve:{name}", doc, LABELS, buckets=LATENCY_BUCKETS,
                                     registry=self.registry))

    def _child(self, family: MetricWrapperBase):
        child = family.labels(**self.labels)
        self._families[id(child)] = family
        return child

    def relabel(self, **labels: str) -> None:
        """Label every later sample with labels (a worker's role after it switched): counters and
        histograms go on as new series, the old ones keeping their totals (a sum over the label
        stays monotone); a gauge's series moves (the old one is removed: it would read twice)."""
        old = [self.labels[name] for name in LABELS]
        self.labels = {**self.labels, **labels}
        for attr, child in list(vars(self).items()):
            family = self._families.pop(id(child), None)
            if family is None:
                continue
            if isinstance(family, Gauge):
                family.remove(*old)
            setattr(self, attr, self._child(family))


KV_TIER_COUNTERS = {"kv_host_hits": "Prefix blocks served from the host-RAM KV tier",
                    "kv_disk_hits": "Prefix blocks served from the disk KV tier",
                    "kv_offloaded_blocks": "Computed blocks the pool evicted into the KV tiers",
                    "kv_disk_writes": "Block files written to the disk KV tier",
                    "kv_tier_refused": "Tier blocks refused (corrupt, truncated, another model's)",
                    "kv_tier_dropped_writes": "Disk tier writes dropped (the write queue was full)",
                    "kv_tier_write_errors": "Disk tier writes that failed (full disk, I/O error)"}
KV_TIER_GAUGES = {"kv_host_blocks": "Blocks held in the host-RAM KV tier", "kv_host_bytes": "Bytes held there",
                  "kv_disk_blocks": "Blocks held in the disk KV tier", "kv_disk_bytes": "Bytes held there"}


class KVTierCollector:
    """The engine's KV tier stats as Prometheus samples, read at scrape time."""

    def __init__(self, engine: "LLMEngine", labels) -> None:
        self.engine, self.labels = engine, labels

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        stats = self.engine.kv_tiers.stats()
        values = self.labels()
        for kinds, family in ((KV_TIER_COUNTERS, CounterMetricFamily), (KV_TIER_GAUGES, GaugeMetricFamily)):
            for key, doc in kinds.items():
                metric = family(f"pdserve:{key}", doc, labels=LABELS)
                metric.add_metric(values, stats[key])
                yield metric


class WorkerMetrics(_Metrics):
    """Engine-side metrics: counters and histograms from the engine thread after every step,
    gauges read from the engine when scraped (see ``attach``)."""

    SHARED = {"num_requests_running": "Sequences in the running batch",
              "prompt_tokens": "Prompt tokens of requests prefilled here",
              "generation_tokens": "Tokens sampled here",
              "request_queue_time_seconds": "Arrival to first scheduled",
              "kv_transfer_seconds": "Seconds per KV send of a chunk's blocks"}

    def __init__(self, role: str, worker_id: str, model_name: str = "") -> None:
        super().__init__(role, worker_id, model_name)
        self.num_requests_waiting = self.gauge("num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_cache_usage_perc = self.gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.prefix_cache_queries = self.counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = self.counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = self.counter("num_preemptions", "Sequences preempted for recompute")
        self.kv_transfer_bytes = self.counter("kv_transfer_bytes", "KV bytes sent (prefill) or received (decode)")
        self.kv_transfer_failures = self.counter("kv_transfer_failures", "KV blocks refused or failed to send")
        self._kv_raw_bytes = Counter("pdserve:kv_raw_bytes", "Prefill: KV bytes delivered, raw, by wire codec",
                                     (*LABELS, "codec"), registry=self.registry)
        self._kv_wire_bytes = Counter("pdserve:kv_wire_bytes", "Prefill: those KV bytes' size on the wire, by wire "
                                      "codec (raw / wire: the compression ratio)", (*LABELS, "codec"),
                                      registry=self.registry)
        self.engine_step_seconds = self.histogram("engine_step_seconds", "Wall time of each engine step")
        self.engine_step_cpu_seconds = self.counter(
            "engine_step_cpu_seconds", "CPU time the engine thread spent in steps (the rest of the process's CPU "
            "time is serving around the engine: RPCs, token delivery, KV receive)")
        self._last = {"queries": 0, "hits": 0, "preemptions": 0}
        self._engine: "LLMEngine | None" = None
        self._tiers_watched = False

    def attach(self, engine: "LLMEngine") -> None:
        """Read the gauges from engine whenever scraped: admission, cancel, abort and finish show
        at once, also on an engine that takes no further step."""
        bm, sched = engine.block_manager, engine.scheduler
        self.num_requests_running.set_function(lambda: len(sched.running))
        self.num_requests_waiting.set_function(lambda: len(sched.waiting))
        self.kv_cache_usage_perc.set_function(bm.usage)
        self._engine = engine
        self.watch_kv_tiers(engine)

    def watch_kv_tiers(self, engine: "LLMEngine") -> None:
        """Publish the engine's KV tier figures (engine/kv/tiers.py), read when scraped: hits per
        tier, blocks offloaded, refused, writes dropped or failed (counters), blocks and bytes held
        per tier (gauges). Nothing is published without tiers."""
        if engine.kv_tiers is None or self._tiers_watched:
            return
        self._tiers_watched = True
        self.registry.register(KVTierCollector(engine, lambda: [self.labels[name] for name in LABELS]))

    def set_role(self, role: str) -> None:
        """The worker switched roles: later samples carry the new role label (``relabel``); the
        gauges read the same engine under it."""
        self.relabel(role=role)
        if self._engine is not None:
            self.attach(self._engine)

    def on_step(self, engine: "LLMEngine", outputs: list["RequestOutput"], timing: "StepTime | None" = None) -> None:
        if timing is not None:
            self.engine_step_seconds.observe(timing.wall_s)
            self.engine_step_cpu_seconds.inc(timing.cpu_s)
        bm = engine.block_manager
        sched = engine.scheduler
        if self._engine is None:
            self.attach(engine)
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

    def kv_sent(self, nbytes: int, seconds: float, wire_bytes: int = 0, codec: str = "off") -> None:
        """Prefill role: one request's KV acknowledged: nbytes raw, wire_bytes on the wire under codec."""
        self.kv_transfer_bytes.inc(nbytes)
        self.kv_transfer_seconds.observe(seconds)
        self._kv_raw_bytes.labels(**self.labels, codec=codec).inc(nbytes)
        self._kv_wire_bytes.labels(**self.labels, codec=codec).inc(wire_bytes or nbytes)

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
        prefilled token and its local-prefill threshold now (+Inf: local at any length), the KV
        transfer time per block and each route's overhead."""
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
                                 "prefilling on this worker is cheaper than remotely, now")
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
                threshold.labels(**labels).set_function(
                    lambda w=w: placement.threshold_now(w) if placement.conditional else math.nan)
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


def _handler(registry: CollectorRegistry, token: str | None) -> type[BaseHTTPRequestHandler]:
    expected = f"Bearer {token}".encode() if token else None

    class MetricsHandler(BaseHTTPRequestHandler):
        """GET/HEAD /metrics (query strings ignored); 404 for every other path; 401 without the
        bearer token when one is set."""

        timeout = READ_TIMEOUT_S    # the socket's timeout: each write's bound (reads: setup)

        def setup(self) -> None:
            """Reads end READ_TIMEOUT_S after the accept, the whole request together."""
            super().setup()
            self.rfile.close()
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + READ_TIMEOUT_S))

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            self.connection.settimeout(READ_TIMEOUT_S)   # the request is read: the answer's writes get their own
            given = (self.headers.get("Authorization") or "").encode("latin-1", "replace")
            if expected is not None and not hmac.compare_digest(given, expected):
                data = b"unauthorized: send the metrics token as Authorization: Bearer TOKEN\n"
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="pdserve metrics"')
                self.send_header("Content-Type", "text/plain; charset=utf-8")
            elif self.path.split("?", 1)[0] != METRICS_PATH:
                data = f"not found; metrics are at {METRICS_PATH}\n".encode()
                self.send_response(404)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
            else:
                encoder, content_type = choose_encoder(self.headers.get("Accept"))
                data = encoder(registry)
                self.send_response(200)
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:   # no access log on stderr
            pass

    return MetricsHandler


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting only for what is left until deadline (time.monotonic()):
    socket.timeout once it has passed, however slowly the bytes before it came."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"the request was not read within {READ_TIMEOUT_S:g}s")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class MetricsServer(ThreadingHTTPServer):
    """One thread per connection, at most max_connections of them and per_peer from one address: a
    connection beyond is closed at once (a scraper retries at its next interval)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int = MAX_CONNECTIONS, per_peer: int = MAX_CONNECTIONS_PER_PEER) -> None:
        super().__init__(address, handler)
        self.max_connections, self.per_peer = max_connections, per_peer
        self._peers: dict[str, int] = {}   # address -> its connections being served
        self._lock = threading.Lock()

    def _admit(self, host: str) -> bool:
        with self._lock:
            mine = self._peers.get(host, 0)
            if sum(self._peers.values()) >= self.max_connections or mine >= self.per_peer:
                return False
            self._peers[host] = mine + 1
            return True

    def _leave(self, host: str) -> None:
        with self._lock:
            left = self._peers.get(host, 0) - 1
            if left > 0:
                self._peers[host] = left
            else:
                self._peers.pop(host, None)

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        if not self._admit(client_address[0]):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._leave(client_address[0])
            raise

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._leave(client_address[0])


def read_metrics_token(path: str | None) -> str | None:
    """The metrics token from a file (path) or $PDSERVE_METRICS_TOKEN; None: no token."""
    return read_secret(path, METRICS_TOKEN_ENV, "metrics token")


def start_metrics_server(registry: CollectorRegistry, host: str, port: int, token: str | None = None) -> int:
    """Serve registry at http://host:port/metrics on a daemon thread; returns the bound port.
    token: scrapes must send it as a bearer token."""
    server = MetricsServer((host, port), _handler(registry, token))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_port

