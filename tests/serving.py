"""Helpers for end-to-end tests against real processes."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import threading
import time
import urllib.request
from typing import Callable, Sequence, TypeVar

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.services.client import AsyncClient
from pdserve.services.deployment.launcher import Cluster, Deployment, free_port

P = TypeVar("P")

TEST_ENGINE_ARGS = ["--block-size", "8", "--num-kv-blocks", "512", "--dtype", "float32"]


# The suites that start deployments here test the disaggregated path (KV hand-offs, prefill
# faults, migrations): every prompt goes to a prefill worker unless a test asks otherwise. The
# default, conditional, lets a decode worker prefill short prompts itself; its own tests say so.
ALWAYS_DISAGGREGATE = ["--disaggregation", "always"]


def pinned_disaggregation(router_args: Sequence[str]) -> list[str]:
    """router_args with --disaggregation always unless they choose a mode."""
    chosen = any(a.split("=")[0] == "--disaggregation" for a in router_args)
    return list(router_args) if chosen else [*router_args, *ALWAYS_DISAGGREGATE]


def start_cluster(model: str, **kwargs) -> Cluster:
    engine_args = kwargs.pop("engine_args", TEST_ENGINE_ARGS)
    kwargs["router_args"] = pinned_disaggregation(kwargs.get("router_args", ()))
    spec = Deployment(model=model, port=free_port(), engine_args=engine_args, metrics=True, **kwargs)
    cluster = Cluster(spec)
    cluster.start(timeout=120)
    return cluster


def channel(cluster: Cluster, address: str) -> grpc.Channel:
    """A blocking channel to a member of the deployment, with its credentials."""
    return cluster.spec.credentials.sync_channel(address)


def aio_channel(cluster: Cluster, address: str) -> grpc.aio.Channel:
    return cluster.spec.credentials.channel(address)


def worker_status(cluster: Cluster, address: str) -> worker_pb2.WorkerStatus:
    with channel(cluster, address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10)


def workers(cluster: Cluster, role: str | None = None) -> list[str]:
    return [p.address for p in cluster.processes if p.name != "router" and (role is None or p.name.startswith(role))]


def assert_blocks_at_baseline(cluster: Cluster, timeout: float = 5.0) -> None:
    """Every worker's free blocks back to its total (no leak), within timeout."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = [worker_status(cluster, a) for a in workers(cluster)]
        if all(s.num_free_blocks == s.num_total_blocks for s in statuses):
            return
        if time.monotonic() > deadline:
            raise AssertionError([(s.worker_id, s.num_free_blocks, s.num_total_blocks) for s in statuses])
        time.sleep(0.05)


def scrape(metrics_address: str) -> dict[str, float]:
    """Prometheus text format -> {series (name + labels): value}."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def metric(samples: dict[str, float], name: str) -> float:
    """Sum of every series of one metric name, whatever its labels."""
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == name)


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.005) -> None:
    """Until condition() holds (polled every interval), or AssertionError naming what after timeout s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


class UpOutput(list):
    """The lines a `pdserve up` printed so far; a background thread keeps appending until EOF."""

    def __init__(self) -> None:
        super().__init__()
        self.pump: threading.Thread | None = None

    def text(self, timeout: float = 30) -> str:
        """Everything printed, once the process has closed its output (waits at most timeout)."""
        if self.pump is not None:
            self.pump.join(timeout)
        return "".join(self)


def wait_up_line(proc: subprocess.Popen, timeout: float = 120) -> UpOutput:
    """Read a `pdserve up`'s output until it says it is up (what a user waits for); keep reading in
    the background so its pipe never fills. Returns the lines collected, growing."""
    lines = UpOutput()
    up = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("pdserve is up"):
                up.set()
        up.set()   # EOF: it exited before saying so

    lines.pump = threading.Thread(target=pump, daemon=True)
    lines.pump.start()
    if not up.wait(timeout) or not any(line.startswith("pdserve is up") for line in lines):
        raise AssertionError("pdserve up did not come up:\n" + "".join(lines[-50:]))
    return lines


def catch_holder(procs: Sequence[P], holds: Callable[[P], bool], pid: Callable[[P], int],
                 already_frozen: bool = False, keep_frozen: bool = False) -> P | None:
    """The one of procs that holds something at this moment (say, a running request), found
    without racing it to the end: every candidate is frozen (SIGSTOP) first (or was, by the
    caller), then each resumed in turn and asked at once, so the holder cannot finish before it
    is asked. All run again on return (none stays frozen for more than the others' questions),
    except, with keep_frozen, the holder: it is frozen again as soon as it has answered, so what
    it held is still there when the caller acts on it (the caller resumes it)."""
    def send(p: P, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):   # one that died meanwhile holds nothing
            os.kill(pid(p), sig)

    for p in procs if not already_frozen else ():
        send(p, signal.SIGSTOP)
    found = None
    try:
        for p in procs:
            send(p, signal.SIGCONT)
            if found is None and holds(p):
                found = p
                if keep_frozen:
                    send(p, signal.SIGSTOP)
    finally:
        for p in procs:
            if not (keep_frozen and p is found):
                send(p, signal.SIGCONT)
    return found


@contextlib.contextmanager
def frozen(pids: Sequence[int]):
    """These processes stopped (SIGSTOP) for the block, resumed after it whatever happens."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


class SteadyLoad:
    """Clients sending fresh prompts (new to every prefix cache, so routing spreads them by load),
    greedy, until stopped; every answer is kept with its prompt, every failure too."""

    def __init__(self, address: str, clients: int = 2, seed: int = 0, max_tokens: int = 10,
                 pause_s: float = 0.0) -> None:
        """pause_s: each client waits this long between an answer and its next request (a rate
        bounded by clients / pause_s, whatever the deployment's speed)."""
        self.address, self.clients, self.pause_s = address, clients, pause_s
        self.rng = random.Random(seed)
        self.params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        self.migrations = 0
        self.outputs: list[tuple[list[int], list[int]]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with AsyncClient(self.address, timeout=60) as client:
            async def one() -> None:
                while not self._stop.is_set():
                    prompt = [self.rng.randrange(1024) for _ in range(self.rng.randint(8, 40))]
                    try:
                        out = await client.generate(prompt, **self.params)
                        self.outputs.append((prompt, out.token_ids))
                        self.migrations += out.timings["migrations"]
                    except grpc.RpcError as exc:
                        self.failures.append(f"{exc.code().name}: {exc.details()}")
                    if self.pause_s:
                        await asyncio.sleep(self.pause_s)
            await asyncio.gather(*(one() for _ in range(self.clients)))

    def __enter__(self) -> "SteadyLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "the load did not stop"

    def served(self, n: int, timeout: float = 60.0) -> None:
        """Until n more requests have finished."""
        target, deadline = len(self.outputs) + n, time.monotonic() + timeout
        while len(self.outputs) < target:
            assert time.monotonic() < deadline, f"the load stalled at {len(self.outputs)} requests: {self.failures}"
            time.sleep(0.05)

    def check(self, reference) -> None:
        """No request failed, and each one's tokens are the offline engine's."""
        assert not self.failures, self.failures
        assert self.outputs
        expected = reference.generate([p for p, _ in self.outputs], _sampling(self.params))
        wrong = [i for i, ((_, toks), out) in enumerate(zip(self.outputs, expected)) if toks != out.token_ids]
        assert not wrong, f"{len(wrong)} of {len(self.outputs)} requests differ from the offline engine's tokens"


def _sampling(params: dict):
    from pdserve.engine import SamplingParams
    return SamplingParams(**params)
