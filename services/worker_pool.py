"""The router's view of its workers: addresses, stubs, polled status, local load counts."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.server import channel

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerHandle:
    address: str
    role: str                                  # "prefill" | "decode" | "both"
    stub: worker_pb2_grpc.WorkerStub = field(init=False)
    status: worker_pb2.WorkerStatus | None = None
    healthy: bool = False
    inflight: int = 0                          # requests the router has on it now
    inflight_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.channel = channel(self.address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    def rebind(self, address: str) -> grpc.aio.Channel:
        """Point at the worker's new address (it was restarted elsewhere); returns the old channel."""
        old, self.address = self.channel, address
        self.channel = channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        return old


class NoWorker(RuntimeError):
    """No healthy worker of the wanted role."""


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], colocated: list[str], poll_s: float = 0.5,
                 resolver: Callable[[WorkerHandle], Awaitable[str | None]] | None = None) -> None:
        self.workers = ([WorkerHandle(a, "prefill") for a in prefill] + [WorkerHandle(a, "decode") for a in decode]
                        + [WorkerHandle(a, "both") for a in colocated])
        if not self.workers:
            raise ValueError("the router needs at least one worker")
        if bool(prefill) != bool(decode):
            raise ValueError("disaggregated serving needs both prefill and decode workers")
        self.poll_s = poll_s
        # Optional: asked for an unreachable worker's current address (e.g. a restarted Ray actor's).
        self.resolver = resolver
        self._task: asyncio.Task | None = None

    @property
    def colocated(self) -> bool:
        return any(w.role == "both" for w in self.workers)

    def of_role(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers if w.role == role]

    async def refresh(self, timeout: float = 2.0) -> None:
        await asyncio.gather(*(self._poll(w, timeout) for w in self.workers))

    async def _poll(self, worker: WorkerHandle, timeout: float, follow: bool = True) -> None:
        try:
            worker.status = await worker.stub.GetStatus(worker_pb2.StatusRequest(), timeout=timeout)
            if not worker.healthy:
                log.info("worker %s (%s) is up", worker.address, worker.role)
            worker.healthy = True
        except grpc.aio.AioRpcError as exc:
            if worker.healthy:
                log.warning("worker %s unreachable: %s", worker.address, exc.code())
            worker.healthy = False
            if follow and self.resolver is not None:
                address = await self.resolver(worker)
                if address and address != worker.address:
                    log.info("worker %s (%s) moved to %s", worker.address, worker.role, address)
                    await worker.rebind(address).close()
                    await self._poll(worker, timeout, follow=False)

    async def wait_ready(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self.refresh()
            if all(w.healthy for w in self.workers):
                return
            if loop.time() > deadline:
                down = [w.address for w in self.workers if not w.healthy]
                raise TimeoutError(f"workers not ready after {timeout}s: {down}")
            await asyncio.sleep(0.2)

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for w in self.workers:
            await w.channel.close()

    def mark_down(self, worker: WorkerHandle) -> None:
        worker.healthy = False

    # ---- choices --------------------------------------------------------------
    def decode_candidates(self) -> list[WorkerHandle]:
        """Healthy decode (or colocated) workers, least loaded first: fewest in-flight
        requests, then most free KV blocks."""
        role = "both" if self.colocated else "decode"
        healthy = [w for w in self.of_role(role) if w.healthy]
        if not healthy:
            raise NoWorker(f"no healthy {role} worker")
        return sorted(healthy, key=lambda w: (w.inflight, -(w.status.num_free_blocks if w.status else 0)))

    def pick_prefill(self) -> WorkerHandle:
        """The prefill worker with the fewest queued prompt tokens (router's count plus its own)."""
        healthy = [w for w in self.of_role("prefill") if w.healthy]
        if not healthy:
            raise NoWorker("no healthy prefill worker")
        return min(healthy, key=lambda w: w.inflight_prompt_tokens + (w.status.num_queued_prompt_tokens if w.status else 0))
