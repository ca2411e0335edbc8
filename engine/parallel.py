"""Tensor parallelism: who holds which slice, and the collectives between ranks.

A worker with ``tensor_parallel_size = N`` is one driver process (rank 0: scheduler, block
manager, sampler, the KV hand-off) plus N-1 rank processes it starts (``RankProcesses`` below;
each runs ``engine/tp_rank.py``).
Every rank holds a slice of every weight and of the paged KV pool, with the same block table:

- column-parallel linears (fused QKV, fused gate/up): each packed shard split by output rows,
  so a rank's q/k/v (or gate/up) stay one matmul;
- row-parallel linears (o_proj, down_proj): split by input columns, summed by an all-reduce;
- the embedding and the LM head: split by vocabulary rows (padded to a multiple of N);
- attention: query heads split evenly; KV heads split evenly when there are at least N of them,
  else each rank holds the one KV head its query heads read (replicated N / num_kv_heads times).

The process group is built directly on a store (no ``init_process_group``), so several engines,
each with its own group, can live in one process (tests, a colocated pair). The driver's store
is a file in a private (0700) directory (engine/tp_rank.py), never a TCP port: no other local
user can read the rendezvous, join the group or rewrite where its ranks listen. Gloo's own
connections bind 127.0.0.1 only.
Collectives run with a timeout (``EngineConfig.tp_collective_timeout_s`` on the driver): a dead
or stalled rank fails the step instead of hanging it.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.engine.config import EngineConfig
from pdserve.engine.step_plan import HEADER_LEN, OP_STOP

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0   # the group's rendezvous (gloo: also its default; every wait has its own timeout)


class RankFailure(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering: the worker cannot step."""


@dataclass(frozen=True, slots=True)
class TPLayout:
    """One rank's share of a model with num_heads query heads and num_kv_heads KV heads."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        check_divisible(self.num_heads, self.num_kv_heads, self.size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def head_range(self) -> tuple[int, int]:
        return self.rank * self.local_heads, (self.rank + 1) * self.local_heads

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """The KV heads this rank holds (global indices, [start, end))."""
        return kv_head_range(self.rank, self.size, self.num_kv_heads)

    def kv_head_ranges(self) -> list[tuple[int, int]]:
        """Every rank's KV head range, in rank order (equal ranges where heads are replicated)."""
        return [kv_head_range(r, self.size, self.num_kv_heads) for r in range(self.size)]


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank * num_kv_heads // size
    return head, head + 1


def check_divisible(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raise ValueError naming the constraint when the heads cannot be split over size ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {num_heads} attention heads")
    if num_kv_heads >= size and num_kv_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {num_kv_heads} KV heads "
                         f"(or be a multiple of it)")
    if num_kv_heads < size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} must be a multiple of the model's {num_kv_heads} KV heads "
                         f"(or divide it)")


def split_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [start, end) of rank's even share of total (total % size == 0)."""
    if total % size:
        raise ValueError(f"{total} does not split over {size} ranks")
    per = total // size
    return rank * per, (rank + 1) * per


def padded_split(total: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, end, per): rank's share of total padded to a multiple of size; end may stop short."""
    per = -(-total // size)
    start = min(rank * per, total)
    return start, min(start + per, total), per


class TPGroup:
    """The collectives of one tensor-parallel group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        """timeout_s: how long one collective may wait for the other ranks."""
        self.rank, self.size, self.device = rank, size, device
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout   # NCCL's watchdog aborts a collective stuck this long
            self.pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:   # a short collective timeout must not cut the rendezvous of a rank still starting
            options = dist.ProcessGroupGloo._Options()
            options._timeout = datetime.timedelta(seconds=max(timeout_s, CONNECT_TIMEOUT_S))
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]   # ranks share a host
            self.pg = dist.ProcessGroupGloo(store, rank, size, options)
        self.timeout = timeout
        self.broken = False

    def _wait(self, work) -> None:
        try:
            work.wait(self.timeout) if self.device.type == "cpu" else work.wait()
        except Exception as exc:   # a peer closed its sockets, or the timeout passed
            self.broken = True
            raise RankFailure(f"tensor-parallel collective failed (a rank died or stalled): {exc}") from exc

    def _check(self) -> None:
        if self.broken:
            raise RankFailure("the tensor-parallel group failed earlier; the worker must be restarted")

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place; returns t."""
        self._check()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._wait(self.pg.allreduce([t], opts))
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._check()
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self.pg.allgather([outs], [t]))
        return outs

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        self._check()
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._wait(self.pg.broadcast([t], opts))
        return t

    def gather_to_driver(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's t (equal shapes) on rank 0, None elsewhere (an all-gather: NCCL and gloo both)."""
        outs = self.all_gather(t)
        return outs if self.rank == 0 else None

    def shutdown(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:
            pass


# ---- the driver's rank processes (each runs engine/tp_rank.py) ------------------------------
START_TIMEOUT_S = 120.0       # a rank must import torch and reach the store within this
STOP_TIMEOUT_S = 5.0          # then it is killed


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
            cmd = [sys.executable, "-m", "pdserve.engine.tp_rank", "--rank", str(rank), "--size", str(size),
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
