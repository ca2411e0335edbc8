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


def _served_order(arrivals: list[tuple[int, str]], capacity: int = 64) -> list[tuple[int, str]]:
    """The order in which requests (priority, client) that all arrive while the head holds its turn
    are admitted."""
    from services.router.admission import Ticket

    async def run():
        queue, order = AdmissionQueue(capacity), []
        head_in, release = asyncio.Event(), asyncio.Event()

        async def head() -> None:
            async with queue.turn(5.0):
                head_in.set()
                await release.wait()

        async def one(priority: int, client: str) -> None:
            async with queue.turn(5.0, Ticket(priority, client)):
                order.append((priority, client))
        first = asyncio.create_task(head())
        await head_in.wait()
        tasks = []
        for p, c in arrivals:
            tasks.append(asyncio.create_task(one(p, c)))
            await asyncio.sleep(0)   # each is queued in arrival order
        release.set()
        await asyncio.gather(first, *tasks)
        return order
    return asyncio.run(run())


def test_a_higher_priority_is_admitted_first_and_fifo_holds_within_one_client() -> None:
    arrivals = [(1, "a"), (1, "a"), (0, "b"), (2, "c"), (0, "b"), (1, "a")]
    assert _served_order(arrivals) == [(0, "b"), (0, "b"), (1, "a"), (1, "a"), (1, "a"), (2, "c")]


def test_two_clients_of_one_class_share_it_one_for_one_whatever_their_sending_rate() -> None:
    """Client a sends three requests for each of b's (all queued behind a busy head): while both
    wait, they are served alternately; a's surplus goes after b has none left."""
    arrivals = [("a" if i % 4 else "b") for i in range(16)]   # b, a, a, a, b, a, a, a, ...
    order = [c for _, c in _served_order([(0, c) for c in arrivals])]
    for n in range(1, 9):   # while both have requests waiting, neither gets more than one ahead
        assert abs(order[:n].count("a") - order[:n].count("b")) <= 1, order
    assert order[8:] == ["a"] * 8


def _behind_a_busy_head(capacity: int, arrivals: list) -> tuple[list[str], dict[str, str]]:
    """A class-1 head holds its turn while arrivals (name, ticket, pause after it) queue behind it,
    then lets go. Returns the admission order (the head first) and each one's outcome: "admitted"
    or the refusal's code."""
    from services.router.admission import Ticket

    async def run():
        queue = AdmissionQueue(capacity)
        head_in, release = asyncio.Event(), asyncio.Event()
        order: list[str] = []
        outcome: dict[str, str] = {}

        async def one(name: str, ticket: Ticket, hold: bool = False) -> None:
            try:
                async with queue.turn(5.0, ticket):
                    if hold:
                        head_in.set()
                        await release.wait()
                    order.append(name)
                    outcome[name] = "admitted"
            except RouterError as exc:
                outcome[name] = exc.code
        tasks = [asyncio.create_task(one("head", Ticket(1), hold=True))]
        await head_in.wait()
        for name, ticket, pause in arrivals:
            tasks.append(asyncio.create_task(one(name, ticket)))
            await asyncio.sleep(pause)
        release.set()
        await asyncio.gather(*tasks)
        return order, outcome
    return asyncio.run(run())


def test_a_full_queue_refuses_the_lowest_class_to_admit_a_higher_one() -> None:
    from services.router.admission import Ticket

    _, outcome = _behind_a_busy_head(2, [
        ("low-1", Ticket(2), 0), ("low-2", Ticket(2), 0),
        ("high", Ticket(0), 0.01),    # full: low-2 (the lowest, latest) makes room
        ("same", Ticket(2), 0.01)])   # full, and outranks nobody: refused
    assert outcome == {"head": "admitted", "low-1": "admitted", "low-2": "RESOURCE_EXHAUSTED",
                       "high": "admitted", "same": "RESOURCE_EXHAUSTED"}


def test_a_moving_request_goes_ahead_of_its_class_and_a_full_queue_never_refuses_it() -> None:
    """A request moving after a fault or an eviction was admitted once: it waits ahead of its
    class's newcomers (not of a higher class), a full queue takes it, and a higher class that
    needs room pushes out a newcomer, never it."""
    from services.router.admission import Ticket

    order, outcome = _behind_a_busy_head(2, [   # the queue is full from new-2 on
        ("new-1", Ticket(1), 0.01), ("new-2", Ticket(1), 0.01), ("moved", Ticket(1, moved=True), 0.01),
        ("high", Ticket(0), 0.01)])
    assert [n for n, o in outcome.items() if o != "admitted"] == ["new-2"]   # room for the higher class:
    assert order == ["head", "high", "moved", "new-1"]                       # the latest newcomer, not the moving one
