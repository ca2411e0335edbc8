"""The admission queue alone: arrival order, the bound on waiters, the wait's timeout, the retry
hint, and the gate in front of it."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.services.router.admission import AdmissionQueue, PendingGate
from pdserve.services.router.errors import RouterError


async def _until(condition, what: str, yields: int = 100) -> None:
    """Until condition() holds, letting the loop's other tasks run in between (no clock involved)."""
    for _ in range(yields):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached: {what}")


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
        await _until(lambda: len(queue) == 3, "the head and two waiting")
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
        await _until(lambda: len(queue) == 1, "the head in its turn")
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
    from pdserve.services.router.admission import Ticket

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
            await _until(lambda: len(queue) == len(tasks) + 1, "queued")   # each is queued in arrival order
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
    """A class-1 head holds its turn while arrivals (name, ticket), one after another, queue behind
    it (or are refused), then lets go. Returns the admission order (the head first) and each one's outcome: "admitted"
    or the refusal's code."""
    from pdserve.services.router.admission import Ticket

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
        for name, ticket in arrivals:
            settled = len(queue) + len(outcome)   # the next arrival queues, is refused, or pushes one out
            tasks.append(asyncio.create_task(one(name, ticket)))
            await _until(lambda: len(queue) + len(outcome) > settled, f"{name} queued or refused")
        release.set()
        await asyncio.gather(*tasks)
        return order, outcome
    return asyncio.run(run())


def test_a_full_queue_refuses_the_lowest_class_to_admit_a_higher_one() -> None:
    from pdserve.services.router.admission import Ticket

    _, outcome = _behind_a_busy_head(2, [
        ("low-1", Ticket(2)), ("low-2", Ticket(2)),
        ("high", Ticket(0)),    # full: low-2 (the lowest, latest) makes room
        ("same", Ticket(2))])   # full, and outranks nobody: refused
    assert outcome == {"head": "admitted", "low-1": "admitted", "low-2": "RESOURCE_EXHAUSTED",
                       "high": "admitted", "same": "RESOURCE_EXHAUSTED"}


def test_a_moving_request_goes_ahead_of_its_class_and_a_full_queue_never_refuses_it() -> None:
    """A request moving after a fault or an eviction was admitted once: it waits ahead of its
    class's newcomers (not of a higher class), a full queue takes it, and a higher class that
    needs room pushes out a newcomer, never it."""
    from pdserve.services.router.admission import Ticket

    order, outcome = _behind_a_busy_head(2, [   # the queue is full from new-2 on
        ("new-1", Ticket(1)), ("new-2", Ticket(1)), ("moved", Ticket(1, moved=True)), ("high", Ticket(0))])
    assert [n for n, o in outcome.items() if o != "admitted"] == ["new-2"]   # room for the higher class:
    assert order == ["head", "high", "moved", "new-1"]                       # the latest newcomer, not the moving one


def test_a_head_that_only_its_own_target_blocks_steps_aside_and_keeps_its_place() -> None:
    """The picky head (a TPOT target no busy worker keeps) steps aside until the workers change:
    the requests behind it are placed meanwhile, and it is the head again after the change,
    before later arrivals of its class. Without step_aside every other request waits behind it
    (the stall of issue 41: 10 normal requests from 0.25 s to 59 s)."""
    from pdserve.services.router.admission import Ticket

    async def run():
        queue, order = AdmissionQueue(8), []
        changed = asyncio.Event()
        tries = 0

        async def picky() -> None:
            nonlocal tries
            async with queue.turn(5.0, Ticket(0, "p")) as turn:
                while not changed.is_set():
                    tries += 1
                    await turn.step_aside(lambda timeout: asyncio.wait_for(changed.wait(), timeout))
                order.append("picky")

        async def normal(i: int) -> None:
            async with queue.turn(5.0, Ticket(0, f"n{i}")):
                order.append(f"n{i}")
                if i == 2:
                    changed.set()   # the third placement changes the workers' state
        tasks = [asyncio.create_task(picky())]
        await _until(lambda: tries >= 1, "picky, the head, stepping aside")
        tasks += [asyncio.create_task(normal(i)) for i in range(5)]
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        return order, tries, len(queue)
    order, tries, left = asyncio.run(run())
    assert order[:3] == ["n0", "n1", "n2"] and "picky" in order and left == 0, order
    assert tries >= 1


def test_a_stepped_aside_head_counts_towards_the_bound_and_times_out_on_its_deadline() -> None:
    from pdserve.services.router.admission import Ticket

    async def run():
        queue = AdmissionQueue(1)
        aside = asyncio.Event()

        async def picky() -> None:
            async with queue.turn(0.3, Ticket(0, "p")) as turn:
                aside.set()
                while True:
                    await turn.step_aside(lambda timeout: asyncio.sleep(timeout))

        async def holder(release: asyncio.Event) -> None:
            async with queue.turn(5.0, Ticket(0, "h")):
                holding.set()
                await release.wait()
        task = asyncio.create_task(picky())
        await aside.wait()
        release, holding = asyncio.Event(), asyncio.Event()
        head = asyncio.create_task(holder(release))   # the head while picky is aside
        await asyncio.wait_for(holding.wait(), 1.0)
        with pytest.raises(RouterError) as full:   # picky (aside) and the head: the queue is full
            async with queue.turn(5.0, Ticket(0, "x")):
                pass
        with pytest.raises(RouterError) as late:
            await task
        release.set()
        await head
        return full.value, late.value, len(queue)
    full, late, left = asyncio.run(run())
    assert "queue is full" in full.message
    assert late.code == "RESOURCE_EXHAUSTED" and "within 0.3s" in late.message, late.message
    assert left == 0


def test_per_class_state_is_dropped_when_a_class_has_nobody_waiting() -> None:
    """A flood of distinct priorities leaves no state behind (issue 41, low 6): the queue's per-class
    maps hold only the classes with requests in the queue, and look-ups create none."""
    from pdserve.services.router.admission import Ticket

    async def run():
        queue = AdmissionQueue(64)
        for p in range(1000):
            queue.ahead_of(Ticket(p, "c"))   # a prediction's look-up
            async with queue.turn(1.0, Ticket(p, "c")):
                pass
        return queue
    queue = asyncio.run(run())
    assert not queue._vtime and not queue._last_tag and not queue._in_class


def test_overload_shares_forget_old_refusals_whatever_the_number_of_priorities() -> None:
    from pdserve.services.router.admission import Ticket
    from pdserve.services.router.slo import OverloadShares
    shares = OverloadShares(window_s=10.0, overload_s=1.0)
    for p in range(10_000):
        shares.refused(Ticket(p, "x"), now=float(p) * 0.01)   # 100 a second, each a new class
    assert len(shares._refused_at) <= 101
    assert shares.yields(Ticket(0, "x"), now=1000.0) is None and not shares._refused_at
