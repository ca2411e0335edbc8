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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics import MetricWrapperBase

from pdserve.engine.settings import ENV
from pdserve.services.common.security import read_secret


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


class ProcessMetrics:
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

