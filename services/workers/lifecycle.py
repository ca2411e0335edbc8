"""A worker's own lifecycle: serving or draining, in which role, and the requests it is working on."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

import grpc


class WorkerState:
    """Draining refuses new requests (UNAVAILABLE, so the router picks another worker) and
    lets the in-flight ones finish; ``wait_idle`` says when they have. ``role``: the role the
    worker serves now (a prefill or decode worker may switch, Worker.SetRole); a call of another
    role's service is refused UNAVAILABLE too, as a worker fault, so the router retries elsewhere."""

    def __init__(self, role: str = "both") -> None:
        self.role = role
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining (shutting down)")

    async def refuse_unless_role(self, context: grpc.aio.ServicerContext, role: str) -> None:
        if self.role != role:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"this worker is a {self.role} worker now: it takes no {role} calls")

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight, False if timeout passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
