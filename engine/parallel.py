"""Tensor parallelism: who holds which slice, and the collectives between ranks.

A worker with ``tensor_parallel_size = N`` is one driver process (rank 0: scheduler, block
manager, sampler, the KV hand-off) plus N-1 rank processes it starts (``engine/tp_rank.py``).
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

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
