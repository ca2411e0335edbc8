"""Fault injection over real processes: a supervised cluster, requests observed token by token,
signals to workers, and the figures docs/reliability.md reports (written to the JSON file named
by $PDSERVE_FAULT_REPORT when it is set)."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.services.client import Client
from pdserve.services.deployment.launcher import PROBE_OPTIONS, Cluster
from tests.conftest import random_prompts
from tests.serving import catch_holder, channel, start_cluster, wait_for

REPORT_ENV = "PDSERVE_FAULT_REPORT"
STALL_S = 3.0
BLOCK_SIZE = 8
FAULT_ENGINE = ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "1024", "--dtype", "float32",
                "--max-num-batched-tokens", "8"]
FAULT_ROUTER = ["--stall-timeout-s", str(STALL_S), "--worker-wait-s", "20", "--migration-limit", "3"]
FAULT_WORKER = ["--kv-lease-idle-s", "3"]


@dataclass
class Observed:
    """One request as its client saw it."""

    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)    # monotonic time of each token
    code: str | None = None                                 # gRPC status name when it failed
    details: str = ""
    finish_reason: str | None = None
    migrations: int = 0
    started: float = 0.0
    ended: float = 0.0
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    def recovery_after(self, t: float) -> float:
        """The longest wait for a token from t on: how long the fault kept this request silent."""
        times = [t, *(a for a in self.arrivals if a > t)]
        return max((b - a for a, b in zip(times, times[1:])), default=float("nan"))


def observe(address: str, prompt: list[int], max_tokens: int, timeout: float = 120.0,
            on_message: Callable[[Observed], None] | None = None, **params) -> Observed:
    """Start a greedy request in a thread and record every token's arrival; on_message, if given,
    runs in that thread after each message is recorded (to act at an exact token, with no lag);
    params: more of the client's sampling parameters (structured_outputs=...)."""
    obs = Observed()

    def run() -> None:
        obs.started = time.monotonic()
        try:
            with Client(address, timeout=timeout) as client:
                for msg in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                  **params):
                    now = time.monotonic()
                    obs.tokens.extend(msg.token_ids)
                    obs.arrivals.extend([now] * len(msg.token_ids))
                    if msg.finished:
                        obs.finish_reason = msg.finish_reason
                        obs.migrations = msg.timings.migrations
                    if on_message is not None:
                        on_message(obs)
        except grpc.RpcError as exc:
            obs.code, obs.details = exc.code().name, exc.details() or ""
        finally:
            obs.ended = time.monotonic()
            obs.done.set()

    threading.Thread(target=run, daemon=True).start()
    return obs


@dataclass
class Busy:
    """Threads keeping one worker busy with long prompts. hold() stops new prompts (the ones in
    flight go on); stop() ends the threads after the prompts in progress."""

    event: threading.Event
    held: threading.Event
    lock: threading.Lock              # a stream checks `held` and counts its prompt under it
    in_flight: list[int]              # [prompts submitted and not yet returned]
    threads: list[threading.Thread]

    def hold(self) -> None:
        """After this returns, in_flight never grows."""
        with self.lock:
            self.held.set()

    def prompts_in_flight(self) -> int:
        with self.lock:
            return self.in_flight[0]

    def stop(self, timeout: float = 60.0) -> None:
        self.event.set()
        for thread in self.threads:
            thread.join(timeout)


class FaultCluster:
    """A cluster whose dead children are restarted (as `pdserve up` does) by a supervisor thread."""

    def __init__(self, model: str, prefill: int = 2, decode: int = 2, engine_args: list[str] | None = None,
                 router_args: list[str] | None = None, worker_args: list[str] | None = None, **cluster) -> None:
        self._log_dir = tempfile.mkdtemp(prefix="pdserve-faults-")   # read by logs(), removed by close()
        try:
            self.cluster: Cluster = start_cluster(model, prefill_workers=prefill, decode_workers=decode,
                                                  engine_args=engine_args or FAULT_ENGINE,
                                                  router_args=router_args or FAULT_ROUTER,
                                                  worker_args=worker_args or FAULT_WORKER, log_dir=self._log_dir,
                                                  **cluster)
        except BaseException:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            raise
        self._busy = itertools.count(1)   # busy prompt numbers (next() is atomic)
        # One channel per worker address, kept (reconnecting within 0.5 s of a restart): a status
        # poll over a new channel took long enough under load to miss a phase of a few hundred ms.
        self._channels: dict[str, grpc.Channel] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        while not self._stop.is_set():
            self.cluster.supervise_once()
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for p in self.cluster.processes:   # nothing stays frozen
            if p.alive:
                os.kill(p.popen.pid, signal.SIGCONT)
        self.cluster.stop()
        for ch in self._channels.values():
            ch.close()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def logs(self, tail_chars: int = 3000) -> str:
        """The end of every process's log, for a failing assertion's message."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail_chars:]}"
                         for p in sorted(Path(self._log_dir).glob("*.log")))

    @property
    def router(self) -> str:
        return self.cluster.router_address

    def process(self, name: str):
        return next(p for p in self.cluster.processes if p.name == name)

    def names(self, role: str) -> list[str]:
        return [p.name for p in self.cluster.processes if p.name.startswith(role)]

    def status(self, name: str) -> worker_pb2.WorkerStatus:
        address = self.process(name).address
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.cluster.spec.credentials.sync_channel(address, PROBE_OPTIONS)
        return worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10)

    def holding(self, role: str, field_name: str) -> str | None:
        """The worker of role whose status field is > 0 (None if none)."""
        for name in self.names(role):
            try:
                if getattr(self.status(name), field_name) > 0:
                    return name
            except grpc.RpcError:
                continue
        return None

    def catch_holding(self, role: str, holds: Callable[[worker_pb2.WorkerStatus], bool],
                      keep_frozen: bool = False) -> str | None:
        """The worker of role whose status satisfies holds, without a race against a phase about
        to end (tests.serving.catch_holder; with keep_frozen it is returned frozen)."""
        def asked(name: str) -> bool:
            try:
                return holds(self.status(name))
            except grpc.RpcError:
                return False
        return catch_holder(self.names(role), asked, lambda name: self.process(name).popen.pid,
                            keep_frozen=keep_frozen)

    def catch_decoding(self, obs: Observed, prompt_len: int, output_len: int, done_tokens: int,
                       left_tokens: int, also: Callable[[str], bool] | None = None) -> str | None:
        """The decode worker running obs's request (it runs alone; its prompt_len tokens make
        output_len), returned frozen so the caller's fault lands on it, while it has made
        done_tokens and has left_tokens or more still to make: its blocks in use say how far it
        is. also(name), if given, must hold of it too; it is asked while the worker runs (say, a
        scrape of its metrics), before its status. What the client has seen says nothing: on a
        loaded machine the stream lagged the worker by hundreds of tokens, and a worker caught
        with its last token already sent let the request finish with no fault. One catch freezes
        every decode worker while each is asked in turn; it is repeated until the request is in
        that window. None if it never was (a test process held off the CPU for the whole window:
        a small model decodes hundreds of tokens in a fraction of a second)."""
        least = -(-(prompt_len + done_tokens) // BLOCK_SIZE)
        most = (prompt_len + output_len - left_tokens) // BLOCK_SIZE

        def decoding(name: str) -> bool:
            # also first: the status must be the last thing asked before the worker is frozen
            # again (it runs meanwhile, and a scrape is slow enough to finish the request)
            if also is not None and not also(name):
                return False
            try:
                s = self.status(name)
            except grpc.RpcError:
                return False
            return s.num_running > 0 and least <= s.num_total_blocks - s.num_free_blocks <= most
        while not obs.done.is_set():
            victim = catch_holder(self.names("decode"), decoding, lambda name: self.process(name).popen.pid,
                                  keep_frozen=True)
            if victim is not None:
                return victim
            time.sleep(0.005)
        return None

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.process(name).popen.pid, sig)

    def busy_prefill(self, name: str, tokens: int, streams: int = 1) -> "Busy":
        """Keep a prefill worker busy, until stopped, with long prompts sent straight to it (no KV
        target, as a member) one after another on each of `streams` threads, so that a request
        arriving at any moment queues behind one. Each prompt is fresh: a prefix-cache hit would
        make it instant."""
        address = self.process(name).address
        busy = Busy(threading.Event(), threading.Event(), threading.Lock(), [0], [])

        def run() -> None:
            with channel(self.cluster, address) as ch:
                stub = worker_pb2_grpc.PrefillWorkerStub(ch)
                while not busy.event.is_set():
                    with busy.lock:
                        if not busy.held.is_set():
                            busy.in_flight[0] += 1
                            n = next(self._busy)
                        else:
                            n = 0
                    if not n:
                        busy.event.wait(0.05)
                        continue
                    prompt = random_prompts(1, tokens, tokens, seed=10_000 + n)[0]
                    try:
                        for _ in stub.Prefill(worker_pb2.PrefillRequest(
                                request_id=f"busy-{n}", prompt_token_ids=prompt,
                                params=common_pb2.SamplingParams(max_tokens=1)), timeout=60):
                            pass
                    except grpc.RpcError:   # the worker was killed or frozen: try again shortly
                        busy.event.wait(0.2)
                    finally:
                        with busy.lock:
                            busy.in_flight[0] -= 1

        busy.threads = [threading.Thread(target=run, daemon=True) for _ in range(streams)]
        for thread in busy.threads:
            thread.start()
        return busy

    def all_healthy(self) -> bool:
        try:
            return all(self.status(p.name).num_total_blocks > 0 for p in self.cluster.processes if p.name != "router")
        except grpc.RpcError:
            return False

    def at_baseline(self) -> bool:
        try:
            statuses = [self.status(p.name) for p in self.cluster.processes if p.name != "router"]
        except grpc.RpcError:
            return False
        return all(s.num_free_blocks == s.num_total_blocks and s.num_reserved == 0 for s in statuses)


def record(case: str, **figures) -> None:
    """Append one case's figures to the report file, when one is asked for."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    report = Path(path)
    rows = json.loads(report.read_text()) if report.exists() else []
    rows.append({"case": case, **figures})
    report.write_text(json.dumps(rows, indent=1))


__all__ = ["BLOCK_SIZE", "FaultCluster", "Observed", "STALL_S", "asdict", "observe", "record", "wait_for"]
