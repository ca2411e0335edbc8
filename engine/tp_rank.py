"""The non-driver ranks of a tensor-parallel worker: their processes, and what each one runs.

The driver (rank 0, the engine's own process) starts ranks 1..N-1 as ``python -m engine.tp_rank``
with the engine config as JSON on argv (nothing pickled), meets them on a file store in a
private directory (0700, removed when the ranks stop: no other user can join or read it; no
port), and from then on drives them with broadcasts: a fixed int64 header says what comes
next (engine/step_plan.py), then int64 payloads and, for KV writes, the KV bytes. Each rank
builds the same model slice and KV pool slice as the driver's ModelRunner and joins the same
collectives in the same order.

Lifecycle: the driver stops its ranks (``RankProcesses.stop``: a STOP header, then SIGKILL after
a timeout); a rank dies with its driver (PR_SET_PDEATHSIG when started from the driver's main
thread, and a parent-pid watchdog either way). A rank that dies or stalls makes the driver's next
collective fail (``RankFailure``) instead of hanging it: every wait has a timeout
(``EngineConfig.tp_collective_timeout_s``), and a failed group's ranks are killed at once.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.parallel import RankFailure, TPGroup
from engine.step_plan import HEADER_LEN, OP_PING, OP_READ_KV, OP_STEP, OP_STOP, OP_WRITE_KV, StepPlan

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0       # a rank must import torch and reach the store within this
STOP_TIMEOUT_S = 5.0          # then it is killed
RANK_IDLE_TIMEOUT_S = 7 * 24 * 3600.0   # a rank waits this long for the driver's next step


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CUDA: rank r on the driver's GPU index + r; CPU: the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _cores_for(rank: int, size: int, threads: int) -> set[int] | None:
    """Rank r's cores (one per thread) out of the driver's, when they are enough for every rank
    (`pdserve up` pins a tensor-parallel worker to threads x ranks cores); else the OS decides."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return set(cores[rank * threads:(rank + 1) * threads]) if len(cores) >= size * threads else None


class RankProcesses:
    """Driver side: ranks 1..N-1, their group, and the one lock every message to them takes."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        size = config.tensor_parallel_size
        self.size = size
        self.lock = threading.RLock()
        self.group: TPGroup | None = None
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.store_dir = tempfile.mkdtemp(prefix="pdserve-tp-")   # 0700: this user's processes only
        store_path = os.path.join(self.store_dir, "store")
        self.store = open_store(store_path, size)
        threads = config.num_threads or 1
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        pdeathsig = threading.current_thread() is threading.main_thread()
        cfg = json.dumps(dataclasses.asdict(config))
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            cmd = [sys.executable, "-m", "engine.tp_rank", "--rank", str(rank), "--size", str(size),
                   "--store-path", store_path, "--driver-pid", str(os.getpid()),
                   "--device", str(rank_device(device, rank)), "--config", cfg]
            if pdeathsig:
                cmd.append("--pdeathsig")
            cores = _cores_for(rank, size, threads)
            if cores:
                cmd += ["--cpus", ",".join(map(str, sorted(cores)))]
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        # Kill the ranks if the driver object is dropped without stop() (and at interpreter exit).
        self._finalizer = weakref.finalize(self, _kill_all, list(self.procs), self.store_dir)
        try:
            self._wait_started()
            self.group = TPGroup(dist.PrefixStore("tp", self.store), 0, size, device,
                                 timeout_s=config.tp_collective_timeout_s)
        except BaseException:
            self._finalizer()
            raise

    def _wait_started(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        keys = [f"up/{r}" for r in range(1, self.size)]
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel ranks did not start within {START_TIMEOUT_S:g}s")
            time.sleep(0.02)

    def check_alive(self) -> None:
        """Raise RankFailure if a rank process has exited (the group is then failed for good)."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                if self.group is not None:
                    self.group.broken = True
                raise RankFailure(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, header: list[int], *tensors: torch.Tensor) -> None:
        """Broadcast a header and its tensors (call under self.lock)."""
        self.check_alive()
        dev = self.group.device
        h = torch.zeros(HEADER_LEN, dtype=torch.int64)
        h[:len(header)] = torch.tensor(header, dtype=torch.int64)
        self.group.broadcast(h.to(dev))
        for t in tensors:
            self.group.broadcast(t.to(dev))

    def stop(self) -> None:
        """Tell the ranks to exit; kill any that has not within STOP_TIMEOUT_S. A failed group (a
        rank died or stalled) cannot pass the message on: its ranks are killed at once."""
        if not self._finalizer.alive:
            return
        healthy = not self.group.broken and all(p.poll() is None for p in self.procs)
        if healthy:
            try:
                with self.lock:
                    self.send([OP_STOP])
            except Exception:   # a rank died meanwhile: kill them all below
                healthy = False
        if healthy:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for proc in self.procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._finalizer()
        self.group.shutdown()


def open_store(path: str, size: int) -> dist.Store:
    """The group's rendezvous: a file only this user can reach (its directory is 0700)."""
    store = dist.FileStore(path, size)
    store.set_timeout(datetime.timedelta(seconds=START_TIMEOUT_S))
    return store


def _kill_all(procs: list[subprocess.Popen], store_dir: str | None = None) -> None:
    if store_dir is not None:
        shutil.rmtree(store_dir, ignore_errors=True)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("tensor-parallel rank pid %d did not exit after SIGKILL", proc.pid)


# ---- the rank process ----------------------------------------------------------------------
def _die_with_driver(driver_pid: int, pdeathsig: bool) -> None:
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:   # the driver may have died before the prctl, or forked us from a thread
        while os.getppid() == driver_pid:
            time.sleep(0.5)
        os._exit(1)
    if os.getppid() != driver_pid:
        os._exit(1)
    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


def serve(runner) -> None:
    """Follow the driver's headers until STOP."""
    group: TPGroup = runner.tp
    dev = group.device
    while True:
        header_t = group.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=dev))
        header = header_t.tolist()
        op = header[0]
        if op == OP_STOP:
            return
        if op == OP_PING:
            continue
        if op == OP_STEP:
            payload = group.broadcast(torch.empty(StepPlan.payload_len(header), dtype=torch.int64, device=dev))
            runner.execute(StepPlan.decode(header, payload.cpu()))
        elif op == OP_WRITE_KV:
            entries = group.broadcast(torch.empty(3 * header[1], dtype=torch.int64, device=dev)).tolist()
            data = group.broadcast(torch.empty(header[2], dtype=runner.dtype, device=dev))
            runner.apply_kv_writes(entries, data)
        elif op == OP_READ_KV:
            ids = group.broadcast(torch.empty(header[1], dtype=torch.int64, device=dev))
            runner.gather_blocks(ids)
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.tp_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store-path", required=True, help="the driver's file store (in a 0700 directory)")
    p.add_argument("--driver-pid", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--config", required=True, help="the driver's EngineConfig as JSON")
    p.add_argument("--pdeathsig", action="store_true")
    p.add_argument("--cpus", default="")
    args = p.parse_args(argv)
    _die_with_driver(args.driver_pid, args.pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's Ctrl-C reaches the driver; it stops us
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(name)s: %(message)s")
    config = EngineConfig(**json.loads(args.config))
    torch.set_num_threads(config.num_threads or 1)

    from engine.model_config import ModelConfig
    from engine.model_runner import ModelRunner

    store = open_store(args.store_path, args.size)
    store.set(f"up/{args.rank}", "1")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TPGroup(dist.PrefixStore("tp", store), args.rank, args.size, device, timeout_s=RANK_IDLE_TIMEOUT_S)
    runner = ModelRunner(config, ModelConfig.from_dir(config.model), group=group)
    try:
        serve(runner)
    except RankFailure as exc:   # the driver went away mid-collective
        log.warning("%s", exc)
        os._exit(1)
    group.shutdown()


if __name__ == "__main__":
    main()
