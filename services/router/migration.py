"""How a request survives its workers: the progress watchdog on every worker stream, the hold
while a role has no healthy worker (a restart), and the migration loop.

When a worker dies, stalls (``stall_timeout_s`` without an event; a request queued or
prefilling there sends progress events, so queued is not stalled) or loses the KV, the attempt
raises WorkerFailure and the request *migrates*: its state on every worker is released and a
new attempt prefills the prompt plus every token already sent elsewhere (prefix-cache hits make
it cheap), so the client sees one unbroken stream with no token missing or repeated. After
``migration_limit`` moves the request fails with the last cause.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

import grpc

from pdserve.services.common import tracing
from pdserve.services.router.errors import RouterError, WorkerFailure
from pdserve.services.router.generation_state import Chunk, Generation
from pdserve.services.router.router_metrics import RouterMetrics
from pdserve.services.router.worker_pool import NoWorker, WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

DEADLINE_MARGIN_S = 1.0        # a request waiting for a worker gives up this long before its deadline,
                               # so that its client hears why (UNAVAILABLE) rather than DEADLINE_EXCEEDED
# Worker answers that are the request's own fault (never retried elsewhere).
REQUEST_ERRORS = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED"}


def refused(code: str, worker: WorkerHandle, details: str | None) -> RouterError | None:
    """The RouterError for a worker's answer that is the request's own fault, else None."""
    if code not in REQUEST_ERRORS:
        return None
    return RouterError(code, f"a worker refused the request ({code})", detail=f"{worker.address}: {details}")


def own_deadline(gen: Generation, until: float) -> tuple[float, bool]:
    """until, or just before the request's own deadline when that is sooner (and whether it was)."""
    own = gen.deadline is not None and gen.deadline - DEADLINE_MARGIN_S < until
    return (gen.deadline - DEADLINE_MARGIN_S if own else until), own


class WorkerWatch:
    """Worker streams under the progress watchdog, and the wait for a role's worker to come back."""

    def __init__(self, pool: WorkerPool, stall_timeout_s: float, worker_wait_s: float) -> None:
        self.pool = pool
        self.stall_timeout_s = stall_timeout_s
        self.worker_wait_s = worker_wait_s

    async def events(self, call, worker: WorkerHandle, gen: Generation):
        """A worker stream under the progress watchdog. Faults become WorkerFailure; an abort
        requested through the router ends the stream quietly. A worker being removed
        (WorkerPool.evict) fails the stream the same way, so the request moves."""
        worker.open_calls += 1
        evicted = asyncio.ensure_future(worker.evicted.wait())
        read: asyncio.Future | None = None
        try:
            while True:
                read = asyncio.ensure_future(call.read())
                done, _ = await asyncio.wait((read, evicted), timeout=self.stall_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if evicted in done:   # first: a stream whose events are always ready would never see it
                    read.cancel()
                    raise WorkerFailure(worker.address, "UNAVAILABLE", "the worker was removed from the deployment")
                if read not in done:
                    read.cancel()
                    raise WorkerFailure(worker.address, "DEADLINE_EXCEEDED",
                                        f"no progress for {self.stall_timeout_s:g}s")
                event = read.result()
                if event is grpc.aio.EOF:
                    return
                yield event
        except grpc.aio.AioRpcError as exc:
            if gen.aborted:
                return
            code = exc.code().name
            error = refused(code, worker, exc.details())
            if error is not None:
                raise error from None
            if code == "UNAVAILABLE":
                self.pool.mark_down(worker)
            raise WorkerFailure(worker.address, code, exc.details() or code) from None
        finally:
            for waiter in (evicted, read):
                if waiter is not None:
                    waiter.cancel()
            worker.open_calls -= 1
            call.cancel()

    async def pick(self, gen: Generation, pick):
        """pick() from the pool. With no healthy worker of the role, wait for one to come back (a
        restart): until worker_wait_s after the role lost its last worker (the same time for every
        waiter), or until just before the request's own deadline; then fail UNAVAILABLE."""
        while True:
            try:
                return pick()
            except NoWorker as exc:
                now = time.monotonic()
                since = self.pool.outage_started(exc.role)
                since = now if since is None else since
                until, own = own_deadline(gen, since + self.worker_wait_s)
                if now >= until:
                    raise self.outage_error(exc, own) from None
                await self.pool.wait_changed(until - now)

    def outage_error(self, exc: NoWorker, own_deadline: bool) -> RouterError:
        now = time.monotonic()
        since = self.pool.outage_started(exc.role) or now
        why = ("before this request's deadline" if own_deadline else
               f"within worker_wait_s={self.worker_wait_s:g}s of losing the last one")
        return RouterError("UNAVAILABLE", f"{exc}: none for {now - since:.1f}s, and none came back {why}")

    async def await_role(self, gen: Generation, role: str) -> None:
        """Wait (as pick) until the role has a healthy worker."""
        def check() -> None:
            if not self.pool.healthy(role):
                raise NoWorker(role)
        await self.pick(gen, check)


class MigrationLoop:
    """Attempts of one request until one finishes, each after a fault on other workers."""

    def __init__(self, limit: int, metrics: RouterMetrics | None = None) -> None:
        self.limit = limit
        self.metrics = metrics

    def migrate(self, gen: Generation, fault: WorkerFailure) -> None:
        """After a fault: count one more move, or raise the RouterError that ends the request."""
        gen.failed.add(fault.address)
        if gen.timing.migrations >= self.limit:
            raise RouterError(fault.code, fault.client_message(),
                              detail=f"after {gen.timing.migrations} migration(s): {fault}") from None
        gen.timing.migrations += 1
        tracing.event(gen.trace, "migration", cause=str(fault), attempt=gen.timing.migrations)
        if self.metrics is not None:
            self.metrics.migrations.inc()
        log.warning("request %s migrates (%d/%d) after %s", gen.request_id, gen.timing.migrations, self.limit, fault)

    async def run(self, gen: Generation, attempt: Callable[[Generation], AsyncIterator[Chunk]],
                  release: Callable[[Generation], Awaitable[None]]) -> AsyncIterator[Chunk]:
        """The request's chunks; the last has a finish_reason. attempt(gen) streams one try (its
        tokens are added to gen.generated as they pass); release(gen) frees it on its workers."""
        while True:
            try:
                async for chunk in attempt(gen):
                    if chunk.token_ids:
                        gen.generated.extend(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        gen.workers.clear()   # the workers freed it themselves
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
                yield Chunk([], "abort")   # only an abort ends an attempt without a finish
                return
            except WorkerFailure as fault:
                await release(gen)
                if gen.aborted:
                    yield Chunk([], "abort")
                    return
                self.migrate(gen, fault)
