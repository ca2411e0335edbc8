"""The admission queue alone: arrival order, the bound on waiters, the wait's timeout, the retry
hint, and the gate in front of it."""
from __future__ import annotations

import asyncio

import pytest

from services.router.admission import AdmissionQueue, PendingGate
from services.router.errors import RouterError


def test_requests_are_admitted_in_arrival_order() -> None:
    async def run():
        queue, order = AdmissionQueue(8), []

        async def one(i: int) -> None:
            async with queue.turn(5.0):
                order.append(i)
                await asyncio.sleep(0.01)   # the head holds its turn while it places
        await asyncio.gather(*(one(i) for i in range(6)))
        return order, len(queue)
    order, left = asyncio.run(run())
    assert order == list(range(6)) and left == 0


def test_a_full_queue_refuses_at_once_with_a_retry_hint() -> None:
    async def run():
        queue = AdmissionQueue(2)
        head_in, release = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with queue.turn(5.0):
                head_in.set()
                await release.wait()
        tasks = [asyncio.create_task(hold()) for _ in range(3)]   # the head and two waiting
        await head_in.wait()
        await asyncio.sleep(0)
        with pytest.raises(RouterError) as err:
            async with queue.turn(5.0):
                pass
        release.set()
        await asyncio.gather(*tasks)
        return err.value
    err = asyncio.run(run())
    assert err.code == "RESOURCE_EXHAUSTED" and "queue is full" in err.message
    assert 1.0 <= err.retry_after_s <= 60.0


def test_a_waiter_times_out_and_the_next_one_still_gets_its_turn() -> None:
    async def run():
        queue = AdmissionQueue(4)
        release = asyncio.Event()

        async def head() -> None:
            async with queue.turn(1.0):
                await release.wait()
        task = asyncio.create_task(head())
        await asyncio.sleep(0)
        with pytest.raises(RouterError) as err:
            async with queue.turn(0.05):
                pass
        release.set()
        await task
        async with queue.turn(0.5):   # the timed-out waiter left no hole in the queue
            pass
        return err.value, len(queue)
    err, left = asyncio.run(run())
    assert err.code == "RESOURCE_EXHAUSTED" and "within 0.05s" in err.message and left == 0


def test_a_zero_queue_admits_only_the_head() -> None:
    async def run():
        queue = AdmissionQueue(0)
        async with queue.turn(1.0):
            with pytest.raises(RouterError):
                async with queue.turn(1.0):
                    pass
    asyncio.run(run())
    with pytest.raises(ValueError):
        AdmissionQueue(-1)


def test_the_pending_gate_refuses_past_its_limit_and_frees_on_exit() -> None:
    gate = PendingGate(2)
    with gate.hold(), gate.hold():
        with pytest.raises(RouterError) as err:
            with gate.hold():
                pass
        assert err.value.code == "RESOURCE_EXHAUSTED"
    assert gate.count == 0
    with gate.hold():
        assert gate.count == 1
