"""`pdserve up`: the router and its workers as separate processes on one machine."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(slots=True)
class Deployment:
    model: str
    prefill_workers: int = 1
    decode_workers: int = 1
    colocated_workers: int = 0          # > 0: serve without disaggregation (the baseline)
    host: str = "127.0.0.1"
    port: int = 50051
    engine_args: list[str] = field(default_factory=list)   # forwarded to every worker
    metrics: bool = False               # give every process a /metrics port
    threads_per_worker: int = 1
    kv_transport: str = "grpc"


@dataclass(slots=True)
class Process:
    name: str
    address: str
    popen: subprocess.Popen
    metrics_address: str | None = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_serving(address: str, popen: subprocess.Popen, timeout: float) -> None:
    """Block until the process at address reports SERVING through grpc.health.v1."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if popen.poll() is not None:
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
    """Starts, health-checks and stops the processes of one deployment."""

    def __init__(self, spec: Deployment) -> None:
        self.spec = spec
        self.processes: list[Process] = []

    @property
    def router_address(self) -> str:
        return f"{self.spec.host}:{self.spec.port}"

    def _spawn(self, name: str, args: list[str], port: int) -> Process:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(self.spec.threads_per_worker))
        metrics = None
        if self.spec.metrics:
            mport = free_port(self.spec.host)
            args = [*args, "--metrics-port", str(mport)]
            metrics = f"{self.spec.host}:{mport}"
        cmd = [sys.executable, "-m", "services.cli", *args, "--host", self.spec.host, "--port", str(port)]
        popen = subprocess.Popen(cmd, env=env, start_new_session=True)
        proc = Process(name, f"{self.spec.host}:{port}", popen, metrics)
        self.processes.append(proc)
        return proc

    def start(self, timeout: float = 180.0) -> None:
        s = self.spec
        worker_args = ["--model", s.model, "--threads", str(s.threads_per_worker), *s.engine_args]
        roles = ([("both", s.colocated_workers)] if s.colocated_workers
                 else [("prefill", s.prefill_workers), ("decode", s.decode_workers)])
        try:
            groups: dict[str, list[str]] = {}
            for role, count in roles:
                for i in range(count):
                    proc = self._spawn(f"{role}-{i}", ["worker", "--role", role, "--worker-id", f"{role}-{i}",
                                                       *worker_args], free_port(s.host))
                    groups.setdefault(role, []).append(proc.address)
            for proc in self.processes:
                wait_serving(proc.address, proc.popen, timeout)
            router_args = ["router", "--model", s.model]
            for role, flag in (("prefill", "--prefill"), ("decode", "--decode"), ("both", "--colocated")):
                if groups.get(role):
                    router_args += [flag, ",".join(groups[role])]
            router = self._spawn("router", router_args, s.port)
            wait_serving(router.address, router.popen, timeout)
        except BaseException:
            self.stop()
            raise

    def describe(self) -> str:
        lines = []
        for p in self.processes:
            extra = f"  metrics http://{p.metrics_address}/metrics" if p.metrics_address else ""
            lines.append(f"  {p.name:<12} {p.address}{extra}")
        return "\n".join(lines)

    def stop(self, timeout: float = 10.0) -> None:
        for p in reversed(self.processes):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.processes:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
        self.processes.clear()

    def wait(self) -> int:
        """Block until SIGINT/SIGTERM or until a process dies; then stop everything."""
        stop = {"flag": False}

        def on_signal(signum, frame):
            stop["flag"] = True

        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        code = 0
        try:
            while not stop["flag"]:
                dead = [p for p in self.processes if p.popen.poll() is not None]
                if dead:
                    print(f"pdserve: {dead[0].name} exited with code {dead[0].popen.returncode}; stopping", flush=True)
                    code = 1
                    break
                time.sleep(0.2)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self.stop()
        return code

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
