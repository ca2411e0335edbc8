"""The migration loop's decisions and the watchdog, with no worker process: a stalled stream is
a fault and a queued one is not; a fault moves the request with the tokens it already sent; the
migration limit ends it with the last cause; a role with no worker holds its requests for
worker_wait_s (or the request's own deadline) and no longer."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.engine import SamplingParams
from pdserve.services.router.errors import RouterError, WorkerFailure
from pdserve.services.router.generation_state import Chunk, Generation, Timing
from pdserve.services.router.migration import MigrationLoop, WorkerWatch
from pdserve.services.router.worker_pool import NoWorker, WorkerPool
from pdserve.v1 import worker_pb2


def _gen(rid: str = "r", deadline: float | None = None) -> Generation:
    return Generation(rid, [1, 2, 3], SamplingParams(max_tokens=8), Timing(time.perf_counter()), deadline=deadline)


class _Stream:
    """A worker stream as grpc.aio gives it: read() per event (after a delay), EOF at the end."""

    def __init__(self, events: list[tuple[float, object]]) -> None:
        self.events = list(events)
        self.cancelled = False

    async def read(self):
        if not self.events:
            return grpc.aio.EOF
        delay, event = self.events.pop(0)
        await asyncio.sleep(delay)   # kept: the scripted stream's own pace (a stall is a long delay)
        return event

    def cancel(self) -> None:
        self.cancelled = True


def _pool() -> WorkerPool:
    return WorkerPool(["127.0.0.1:2"], ["127.0.0.1:1"], [], stale_s=3.0)


async def _collect(watch: WorkerWatch, stream: _Stream, gen: Generation) -> list:
    pool = watch.pool
    return [e async for e in watch.events(stream, pool.of_role("decode")[0], gen)]


def test_a_silent_stream_is_a_stall_and_its_call_is_cancelled() -> None:
    async def run():
        watch = WorkerWatch(_pool(), stall_timeout_s=0.2, worker_wait_s=1.0)
        stream = _Stream([(5.0, "never")])
        with pytest.raises(WorkerFailure) as err:
            await _collect(watch, stream, _gen())
        await watch.pool.close()
        return err.value, stream
    fault, stream = asyncio.run(run())
    assert fault.code == "DEADLINE_EXCEEDED" and stream.cancelled


def test_a_queued_request_sending_progress_is_not_stalled() -> None:
    """Progress events every 0.05 s for 0.6 s against a 0.2 s watchdog: alive all along."""
    async def run():
        watch = WorkerWatch(_pool(), stall_timeout_s=0.2, worker_wait_s=1.0)
        progress = worker_pb2.GenerateLocalEvent(progress=worker_pb2.Progress())
        events = await _collect(watch, _Stream([(0.05, progress)] * 12), _gen())
        await watch.pool.close()
        return events
    assert len(asyncio.run(run())) == 12


def test_a_fault_migrates_with_the_generated_tokens_under_a_new_attempt_id() -> None:
    seen = []

    async def attempt(gen: Generation):
        seen.append((list(gen.generated), gen.worker_request_id, set(gen.failed)))
        if len(seen) == 1:
            yield Chunk([7, 8])
            raise WorkerFailure("decode-a", "UNAVAILABLE", "gone")
        yield Chunk([9], "length")

    released = []

    async def release(gen: Generation) -> None:
        released.append(gen.worker_request_id)

    async def run():
        gen = _gen()
        chunks = [c async for c in MigrationLoop(limit=3).run(gen, attempt, release)]
        return gen, chunks
    gen, chunks = asyncio.run(run())
    assert [c.token_ids for c in chunks] == [[7, 8], [9]] and chunks[-1].finish_reason == "length"
    assert seen == [([], "r", set()), ([7, 8], "r@1", {"decode-a"})]
    assert released == ["r"] and gen.generated == [7, 8, 9] and gen.timing.migrations == 1


def test_past_the_migration_limit_the_request_fails_with_the_last_cause() -> None:
    async def attempt(gen: Generation):
        raise WorkerFailure(f"w{gen.timing.migrations}", "DATA_LOSS", "block 3 failed its check")
        yield   # an async generator

    async def release(gen: Generation) -> None:
        pass

    async def run():
        gen = _gen()
        with pytest.raises(RouterError) as err:
            [c async for c in MigrationLoop(limit=2).run(gen, attempt, release)]
        return gen, err.value
    gen, err = asyncio.run(run())
    assert err.code == "DATA_LOSS" and "after 2 migration(s)" in err.detail
    assert gen.timing.migrations == 2 and gen.failed == {"w0", "w1", "w2"}


def test_a_fault_after_an_abort_ends_quietly() -> None:
    async def attempt(gen: Generation):
        gen.aborted = True
        raise WorkerFailure("w", "CANCELLED", "")
        yield

    async def release(gen: Generation) -> None:
        pass

    async def run():
        return [c async for c in MigrationLoop(limit=3).run(_gen(), attempt, release)]
    chunks = asyncio.run(run())
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([], "abort")]


def _no_decode(pool: WorkerPool) -> None:
    if not pool.healthy("decode"):
        raise NoWorker("decode")


def test_a_role_without_workers_holds_requests_for_worker_wait_s_then_fails() -> None:
    async def run():
        pool = _pool()
        pool.started_at = time.monotonic()
        watch = WorkerWatch(pool, stall_timeout_s=1.0, worker_wait_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(RouterError) as err:
            await watch.pick(_gen(), lambda: _no_decode(pool))
        await pool.close()
        return err.value, time.monotonic() - t0
    err, waited = asyncio.run(run())
    assert err.code == "UNAVAILABLE" and "worker_wait_s=0.3s" in err.message
    assert 0.25 <= waited < 2.0, waited


def test_the_requests_own_deadline_bounds_the_hold() -> None:
    async def run():
        pool = _pool()
        watch = WorkerWatch(pool, stall_timeout_s=1.0, worker_wait_s=60.0)
        t0 = time.monotonic()
        with pytest.raises(RouterError) as err:
            await watch.pick(_gen(deadline=t0 + 1.2), lambda: _no_decode(pool))
        await pool.close()
        return err.value, time.monotonic() - t0
    err, waited = asyncio.run(run())
    assert "before this request's deadline" in err.message and waited < 1.0, waited


def test_a_worker_coming_back_releases_the_hold() -> None:
    async def run():
        pool = _pool()
        watch = WorkerWatch(pool, stall_timeout_s=1.0, worker_wait_s=30.0)
        worker = pool.of_role("decode")[0]
        holding, wait_changed = asyncio.Event(), pool.wait_changed

        async def held(timeout: float | None = None) -> None:
            holding.set()
            await wait_changed(timeout)
        pool.wait_changed = held

        async def restart():
            await holding.wait()   # the request waits for a decode worker: then it comes back
            worker.status, worker.connected = worker_pb2.WorkerStatus(num_free_blocks=8), True
            pool.settle(worker, [])   # any change wakes the waiters
        asyncio.get_running_loop().create_task(restart())
        t0 = time.monotonic()
        await watch.await_role(_gen(), "decode")
        await pool.close()
        return time.monotonic() - t0
    assert asyncio.run(run()) < 2.0
