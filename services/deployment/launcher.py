"""`pdserve up`: the router and its workers as separate processes on one machine, supervised.

- One cluster token per deployment (unless one is given), handed to the children through the
  environment; nothing secret goes into argv. Likewise one admin token (membership changes),
  handed to the router only: workers hold the cluster token alone.
- The router's port is checked before anything starts.
- Every gRPC/HTTP port a child serves is reserved by the supervisor for the deployment's
  lifetime (services/common/ports.py), so a child that dies is restarted on the same port, with
  exponential backoff, and no other local user can bind that port meanwhile; the router
  notices through its status streams. Health probes carry no secret.
- Children never outlive the supervisor: they ask the kernel to kill them when it dies
  (PR_SET_PDEATHSIG, see ``die_with_parent``), and SIGTERM/SIGINT at any moment, start-up
  included, stops them all: the router first (it drains), then the workers.
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.settings import ENV, setting
from pdserve.services.common.grpc_setup import check_port_free
from pdserve.services.common.ports import PortReservations, RESERVED_PORTS_ENV, free_port
from pdserve.services.common.security import ADMIN_TOKEN_ENV, Credentials, new_token
from pdserve.services.common.topology import (DEFAULT_HOST, ROUTER_PORT, Topology, WORKER_THREADS,
    drain_timeout_setting, flags_argv, role_argv)
from pdserve.services.kv_transfer import shared_memory

if TYPE_CHECKING:
    from pdserve.services.deployment.progress import Progress

PARENT_PID_ENV = ENV.PARENT_PID.name
PROBE_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                 ("grpc.max_reconnect_backoff_ms", 500)]
RESTART_BACKOFF_S = (1.0, 30.0)     # first and largest delay before restarting a dead child
SUPERVISE_POLL_S = 0.2              # how often the supervisor looks for dead children
# The router holds requests for a restarting worker (its --worker-wait-s) for the backoff of the
# RESTART_WAIT_ROUNDS-th restart in a row, a poll, and the slowest worker's measured start-up
# RESTART_SLOWDOWN times over (a restart competes with the serving ones, and on a busy host with
# everything else, for the cores: twice was too little with two suites on two cores) plus
# RESTART_SLACK_S.
RESTART_WAIT_ROUNDS = 3
RESTART_SLOWDOWN = 3.0
RESTART_SLACK_S = 5.0
STABLE_S = 60.0                     # a child up this long has its backoff reset


class Stopped(Exception):
    """The supervisor was asked to stop (SIGTERM / SIGINT) while it was starting."""




@dataclass(slots=True)
class Deployment:
    model: str = field(metadata={"help": "HF checkpoint directory"})
    prefill_workers: int = setting(1, "prefill worker processes")
    decode_workers: int = setting(1, "decode worker processes")
    colocated_workers: int = setting(0, "colocated (prefill + decode) worker processes instead: the baseline")
    host: str = setting(DEFAULT_HOST, "address every process binds")
    port: int = setting(ROUTER_PORT, "the router's public gRPC port")
    metrics: bool = setting(False, "give every process a Prometheus /metrics endpoint (on free ports unless "
                              "--metrics-port-base is given)")
    metrics_port_base: int | None = setting(None, "fixed metrics ports: the router on N, the workers on N+1, N+2, ... "
                                             "(prefill, then decode; implies --metrics); none: free ports")
    metrics_token_file: str | None = setting(None, "every /metrics endpoint wants this file's token as a bearer token "
                                              "(default: $PDSERVE_METRICS_TOKEN, else none)")
    log_dir: str | None = setting(None, "write each child's output to DIR/NAME.log instead of this terminal "
                                   "(`pdserve up` default: $PDSERVE_HOME/logs/up-PORT)")
    threads_per_worker: int = setting(WORKER_THREADS, "torch threads of each worker process", aliases=("--threads",))
    restart: bool = setting(True, "restart a child that dies (with backoff) instead of stopping the deployment")
    pin_workers: bool = setting(True, "give each worker its own cores (one per torch thread) when the machine has "
                                 "enough for all of them; the router floats")
    drain_timeout_s: float = drain_timeout_setting()
    prefill_tp: int | None = setting(None, "tensor_parallel_size of the prefill workers (each starts its ranks); "
                                      "none: --tensor-parallel-size")
    decode_tp: int | None = setting(None, "tensor_parallel_size of the decode workers; none: --tensor-parallel-size "
                                     "(any pair of layouts hands KV over)")
    engine_tp: int = field(default=1, metadata={"cli": False})   # the engine's --tensor-parallel-size
    engine_args: list[str] = field(default_factory=list, metadata={"cli": False})   # forwarded to every worker
    worker_args: list[str] = field(default_factory=list, metadata={"cli": False})   # forwarded to every worker
    router_args: list[str] = field(default_factory=list, metadata={"cli": False})   # forwarded to the router
    credentials: Credentials = field(default_factory=Credentials, metadata={"cli": False})

    def __post_init__(self) -> None:
        self.topology   # validates the shape
        if self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads_per_worker}")
        if self.metrics_port_base is not None:
            if not 1 <= self.metrics_port_base <= 65535 - self.num_workers:
                raise ValueError(f"metrics_port_base must leave room for {self.num_workers + 1} ports below 65536, "
                                 f"got {self.metrics_port_base}")
            self.metrics = True

    @property
    def topology(self) -> Topology:
        """The deployment's shape (services/common/topology.py), read by the supervisor."""
        return Topology(self.prefill_workers, self.decode_workers, self.colocated_workers, self.prefill_tp,
                        self.decode_tp, self.engine_tp, self.host, self.port)

    @property
    def num_workers(self) -> int:
        return self.topology.num_workers

    def tp(self, role: str) -> int:
        """The tensor_parallel_size of a role's workers."""
        return self.topology.tp(role)

    def roles(self) -> list[tuple[str, int]]:
        """(role, count) in start order; metrics ports follow it."""
        return self.topology.roles()

    def metrics_ports(self) -> dict[str, int]:
        """name -> fixed metrics port (empty without metrics_port_base)."""
        return {} if self.metrics_port_base is None else self.topology.port_layout(self.metrics_port_base)


@dataclass(eq=False)
class Process:
    name: str
    cmd: list[str]
    address: str
    env: dict[str, str]
    popen: subprocess.Popen | None = None
    metrics_address: str | None = None
    restarts: int = 0
    started_at: float = 0.0
    start_s: float = 0.0               # how long its last start took to SERVING
    next_start: float = 0.0
    log_path: str | None = None        # the child's stdout and stderr go here (None: inherited)
    cpus: set[int] | None = None       # cores it runs on (None: any)

    def start(self) -> None:
        if self.log_path is None:
            self.popen = subprocess.Popen(self.cmd, env=self.env, start_new_session=True)
        else:
            with open_log(self.log_path) as log:   # appended: restarts keep the earlier output
                self.popen = subprocess.Popen(self.cmd, env=self.env, start_new_session=True, stdout=log,
                                              stderr=subprocess.STDOUT)
        if self.cpus:
            # Popen returns once the child runs python, before it starts any thread: every
            # thread it makes later inherits these cores.
            try:
                os.sched_setaffinity(self.popen.pid, self.cpus)
            except OSError:
                pass
        self.started_at = time.monotonic()

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the child's log ("" when it writes to the terminal)."""
        if self.log_path is None:
            return ""
        try:
            with os.fdopen(os.open(self.log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def open_log(path: str):
    """A child's log file, opened to append: created private (0600), and never through a symbolic
    link or onto anything but a regular file, so that a link planted in the log directory cannot
    make the supervisor write (or truncate, or block on) another file. OSError naming the path."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise OSError(exc.errno, f"log file {path} {why}: not written") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"log file {path} is not a regular file: not written")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


def die_with_parent() -> None:
    """In a child of `pdserve up`: be killed by the kernel when the supervisor dies (Linux)."""
    parent = ENV.PARENT_PID.raw()
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):    # it died before the prctl took effect
        os._exit(1)


def probe_serving(stub: health_pb2_grpc.HealthStub) -> bool:
    """One quick grpc.health.v1 check: SERVING or not (yet)."""
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_serving(address: str, popen: subprocess.Popen | None, timeout: float,
                 credentials: Credentials | None = None, stopping: Callable[[], bool] = lambda: False) -> None:
    """Block until the process at address reports SERVING through grpc.health.v1. The probe's
    channel reconnects within half a second, so a server that just came up is seen at once."""
    deadline = time.monotonic() + timeout
    creds = credentials or Credentials()
    with creds.probe_channel(address, PROBE_OPTIONS) as ch:   # health checks carry no secret
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if stopping():
                raise Stopped()
            if popen is not None and popen.poll() is not None:
                raise RuntimeError(f"process for {address} exited with code {popen.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout}s")
            time.sleep(0.1)


class Cluster:
    """Starts, health-checks, supervises and stops the processes of one deployment."""

    def __init__(self, spec: Deployment) -> None:
        self.spec = spec
        self.processes: list[Process] = []
        if spec.credentials.cluster_token is None or spec.credentials.admin_token is None:   # fresh secrets
            c = spec.credentials
            spec.credentials = Credentials(c.cluster_token or new_token(), c.tls, c.admin_token or new_token())
        self._stop_requested = False
        self._pinned = self._cores()
        self.ports = PortReservations()   # held until stop(): no other user can take a child's port

    @property
    def router_address(self) -> str:
        return f"{self.spec.host}:{self.spec.port}"

    def request_stop(self, *_: object) -> None:
        self._stop_requested = True

    def _cores(self) -> dict[str, set[int]]:
        """Process name -> its cores, when there are enough for every worker to have its own.

        A prefill step's length is a request's time to first token, so nothing else runs on a
        prefill worker's cores. The router (which streams every token) gets the cores no worker
        has. When there are none it shares the last decode worker's cores (P/D workers: a
        moment's delay there costs an inter-token gap the decode batch absorbs; floating over
        both cores of a 2-core 1P1D measured TTFT p99 1.1-1.5x pinned, as
        docs/benchmarks-history.md records), or floats (colocated workers)."""
        s = self.spec
        if not s.pin_workers or not hasattr(os, "sched_getaffinity"):
            return {}
        names = s.topology.names()[1:]   # the workers, in start order
        cores = sorted(os.sched_getaffinity(0))
        # A tensor-parallel worker's ranks pin themselves within its cores (engine/tp_rank.py).
        widths = [s.threads_per_worker * s.tp(name.rsplit("-", 1)[0]) for name in names]
        if sum(widths) > len(cores):
            return {}
        pinned, at = {}, 0
        for name, width in zip(names, widths):
            pinned[name] = set(cores[at:at + width])
            at += width
        spare = set(cores[at:])
        if spare:
            pinned["router"] = spare
        elif not s.colocated_workers:
            pinned["router"] = pinned[names[-1]]
        return pinned

    def _process(self, name: str, args: list[str], port: int, reserved: list[int] = ()) -> Process:
        """reserved: the ports of this child that the supervisor holds (it binds them with SO_REUSEPORT)."""
        env = {**os.environ, **self.spec.credentials.child_env(admin=name == "router"),
               PARENT_PID_ENV: str(os.getpid())}
        if name != "router":
            env.pop(ADMIN_TOKEN_ENV, None)   # a worker never holds the admin token
        env.pop(RESERVED_PORTS_ENV, None)
        env.update(self.ports.env(list(reserved)))
        env.setdefault("OMP_NUM_THREADS", str(self.spec.threads_per_worker))
        metrics = None
        if self.spec.metrics:
            mport = self.spec.metrics_ports().get(name) or free_port(self.spec.host)
            args = [*args, "--metrics-port", str(mport)]
            if self.spec.metrics_token_file:   # a path, not the secret
                args = [*args, "--metrics-token-file", self.spec.metrics_token_file]
            metrics = f"{self.spec.host}:{mport}"
        tls = self.spec.credentials.tls
        if tls is not None:   # file paths, not secrets: they travel as flags
            args = [*args, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]
        cmd = [sys.executable, "-m", "pdserve.services.cli", *args, "--host", self.spec.host, "--port", str(port)]
        log_path = os.path.join(self.spec.log_dir, f"{name}.log") if self.spec.log_dir else None
        proc = Process(name, cmd, f"{self.spec.host}:{port}", env, metrics_address=metrics, log_path=log_path,
                       cpus=self._pinned.get(name))
        self.processes.append(proc)
        return proc

    def _check_ports(self) -> None:
        """Every fixed port is free before anything starts (OSError naming the one in use); the
        router's ports are then reserved."""
        check_port_free(self.spec.host, self.spec.port)
        for port in (self.spec.port, self.http_port):
            if port:
                check_port_free(self.spec.host, port)
                self._reserve(port)
        for name, port in self.spec.metrics_ports().items():
            try:
                check_port_free(self.spec.host, port)
            except OSError as exc:
                raise OSError(exc.errno, f"metrics port of {name}: {exc.strerror}; choose another "
                                         f"--metrics-port-base") from None

    @property
    def http_port(self) -> int | None:
        """The router's OpenAI HTTP port, when fixed (router_args' --http-port N, N > 0)."""
        args = self.spec.router_args
        if "--http-port" in args[:-1]:
            value = args[args.index("--http-port") + 1]
            return int(value) if value.isdigit() and int(value) > 0 else None
        return None

    def _reserve(self, port: int) -> None:
        try:
            self.ports.reserve(port)
        except OSError as exc:
            # Free for a listener (checked) but not for a reservation: connections in TIME_WAIT of
            # a server that did not share the port. Serve it unreserved rather than not at all.
            print(f"pdserve: warning: {exc.strerror}: a restart of its "
                  f"process leaves it open to other local users meanwhile", file=sys.stderr, flush=True)

    def start(self, timeout: float = 180.0, progress: "Progress | None" = None) -> None:
        """Start every process and wait until each is SERVING (workers first, then the router).
        Raises Stopped if a stop was requested meanwhile, after stopping whatever had started.
        progress: say what is starting and which processes are up so far."""
        s = self.spec
        self._check_ports()
        if s.log_dir:
            os.makedirs(s.log_dir, mode=0o700, exist_ok=True)
        try:
            groups: dict[str, list[str]] = {}
            for role, count in s.roles():
                for i in range(count):
                    proc = self._process(f"{role}-{i}", self.worker_argv(role, f"{role}-{i}"),
                                         port := self.ports.reserve(), reserved=[port])
                    proc.start()
                    groups.setdefault(role, []).append(proc.address)
            workers = list(self.processes)
            self._wait_all(workers, timeout, progress, f"starting {len(workers)} worker(s) (loading the model)")
            router = self._process("router", self.router_argv(groups, self.restart_wait_s(workers)), s.port,
                                   reserved=[p for p in (s.port, self.http_port) if p in self.ports.ports])
            router.start()
            self._wait_all([router], timeout, progress, "starting the router")
        except BaseException:
            self.stop()
            raise

    def add_worker(self, role: str, worker_id: str, extra_args: Sequence[str] = (), timeout: float = 120.0) -> Process:
        """Start one more worker beside the running deployment (one that joins the router with
        ``--router``, say), supervised and stopped with the rest; returns once it is SERVING."""
        proc = self._process(worker_id, [*self.worker_argv(role, worker_id), *extra_args], port := self.ports.reserve(),
                             reserved=[port])
        proc.start()
        self._wait_all([proc], timeout, None, f"starting {worker_id}")
        return proc

    def worker_argv(self, role: str, worker_id: str) -> list[str]:
        """A worker's argv (before its --host/--port): the spec's engine and worker settings."""
        s = self.spec
        return [*role_argv("worker", role=role, worker_id=worker_id, model=s.model, num_threads=s.threads_per_worker,
                           drain_timeout_s=s.drain_timeout_s), *s.engine_args, *s.worker_args,
                *flags_argv(tensor_parallel_size=s.tp(role) if s.tp(role) != s.engine_tp else None)]

    def router_argv(self, groups: dict[str, list[str]], worker_wait_s: float) -> list[str]:
        """The router's argv: the spec's router settings, the workers' addresses by role, and (unless
        given) a worker wait as long as a worker's restart."""
        s = self.spec
        given = {a.split("=")[0] for a in s.router_args}
        wait = None if {"--worker-wait-s", "--worker-wait"} & given else f"{worker_wait_s:.1f}"
        return [*role_argv("router", model=s.model, drain_timeout_s=s.drain_timeout_s), *s.router_args,
                *flags_argv(worker_wait_s=wait, prefill=",".join(groups.get("prefill", [])) or None,
                            decode=",".join(groups.get("decode", [])) or None,
                            colocated=",".join(groups.get("both", [])) or None)]

    def _wait_all(self, procs: list[Process], timeout: float, progress: "Progress | None", what: str) -> None:
        """Wait until every process in procs is SERVING, probing them round-robin."""
        from contextlib import nullcontext

        deadline = time.monotonic() + timeout
        pending = {p.name: p for p in procs}
        channels = {p.name: self.spec.credentials.probe_channel(p.address, PROBE_OPTIONS) for p in procs}
        stubs = {name: health_pb2_grpc.HealthStub(ch) for name, ch in channels.items()}
        step_cm = progress.step(what, done="up") if progress is not None else nullcontext()
        try:
            with step_cm as step:
                while pending:
                    if self._stop_requested:
                        raise Stopped()
                    for name, p in list(pending.items()):
                        if p.popen is not None and p.popen.poll() is not None:
                            tail = p.log_tail()
                            raise RuntimeError(f"{name} exited with code {p.popen.returncode} during start-up"
                                               + (f"; the end of {p.log_path}:\n{tail}" if tail else ""))
                        if probe_serving(stubs[name]):
                            p.start_s = time.monotonic() - p.started_at
                            del pending[name]
                            if step is not None and len(procs) > 1:
                                progress.say(f"{name} is up at {p.address} ({step.elapsed:.1f}s)")
                    if step is not None and pending:
                        step.update(f"waiting for {', '.join(pending)}")
                    if pending and time.monotonic() > deadline:
                        raise TimeoutError(f"{', '.join(pending)} not SERVING after {timeout:g}s"
                                           + (f" (logs in {self.spec.log_dir})" if self.spec.log_dir else ""))
                    if pending:
                        time.sleep(0.1)
        finally:
            for ch in channels.values():
                ch.close()

    @staticmethod
    def restart_wait_s(workers: list[Process]) -> float:
        """How long a restart of one of these workers takes at most, as far as the supervisor
        knows: what the router waits for a role that lost its last worker."""
        slowest = max((p.start_s for p in workers), default=0.0)
        backoff = min(RESTART_BACKOFF_S[0] * 2 ** (RESTART_WAIT_ROUNDS - 1), RESTART_BACKOFF_S[1])
        return backoff + SUPERVISE_POLL_S + RESTART_SLOWDOWN * slowest + RESTART_SLACK_S

    def describe(self) -> str:
        lines = []
        for p in self.processes:
            extra = f"  metrics http://{p.metrics_address}/metrics" if p.metrics_address else ""
            lines.append(f"  {p.name:<12} {p.address}{extra}")
        return "\n".join(lines)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the router (it drains), then the workers; SIGKILL whatever outlives timeout."""
        timeout = self.spec.drain_timeout_s + 5 if timeout is None else timeout
        deadline = time.monotonic() + timeout
        router = [p for p in self.processes if p.name == "router"]
        workers = [p for p in self.processes if p.name != "router"]
        for group in (router, workers):
            for p in group:
                if p.alive:
                    p.popen.send_signal(signal.SIGTERM)
            for p in group:
                if p.popen is None:
                    continue
                try:
                    p.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait()
                self._remove_segments(p)
        self.processes.clear()
        self.ports.close()

    def _remove_segments(self, p: Process) -> None:
        """A child that exited leaves no KV shared-memory segment behind (one killed between
        writing a segment and its receiver taking it would, until a sweep)."""
        if p.popen is None or p.popen.poll() is None:
            return
        args = self.spec.worker_args
        flag = "--kv-shared-memory-dir"
        directory = args[args.index(flag) + 1] if flag in args[:-1] else shared_memory.SHM_DIR
        try:
            shared_memory.remove_owned(p.popen.pid, directory)
        except OSError:
            pass

    def supervise_once(self) -> list[str]:
        """Restart dead children whose backoff has passed. Returns what it did, for the log."""
        events = []
        now = time.monotonic()
        for p in self.processes:
            if p.alive:
                if p.restarts and now - p.started_at > STABLE_S:
                    p.restarts = 0
                continue
            if p.popen is not None and p.next_start == 0.0:
                self._remove_segments(p)
                delay = min(RESTART_BACKOFF_S[0] * 2 ** p.restarts, RESTART_BACKOFF_S[1])
                p.next_start = now + delay
                events.append(f"{p.name} exited with code {p.popen.returncode}; restarting in {delay:g}s")
            elif now >= p.next_start:
                p.restarts += 1
                p.next_start = 0.0
                try:
                    p.start()
                except OSError as exc:   # its log file cannot be opened: tried again after the next backoff
                    events.append(f"{p.name} not restarted: {exc}")
                    continue
                events.append(f"{p.name} restarted (pid {p.popen.pid})")
        return events

    def wait(self) -> int:
        """Supervise until SIGINT/SIGTERM; then stop everything. Returns the exit code."""
        try:
            while not self._stop_requested:
                if self.spec.restart:
                    for event in self.supervise_once():
                        print(f"pdserve: {event}", flush=True)
                elif any(not p.alive for p in self.processes):
                    dead = next(p for p in self.processes if not p.alive)
                    print(f"pdserve: {dead.name} exited with code {dead.popen.returncode}; stopping", flush=True)
                    return 1
                time.sleep(SUPERVISE_POLL_S)
            return 0
        finally:
            self.stop()

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
