"""The admission queue alone: arrival order, the bound on waiters (a count, named when it refuses),
the wait's timeout (opt-in), the retry hint, and the gate in front of it. Then the router's queue
over a pool whose decode worker is full (no worker process): a burst waits holding nothing, past
the count it is refused, and a wait ends with queue_timeout_s, the client's deadline, or the client."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import pytest

from pdserve.engine import SamplingParams
from pdserve.services.router.admission import AdmissionQueue, PendingGate
from pdserve.services.router.config import GenerationOptions
from pdserve.services.router.errors import RouterError
from pdserve.services.router.generator import Generator
from pdserve.services.router.router_metrics import RouterMetrics
from pdserve.services.router.worker_pool import WorkerPool
from pdserve.v1 import worker_pb2


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
    assert "max_queued_requests=2, set by --max-queued-requests" in err.message   # the limit, and how to raise it
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


# ---- the bound is a count; the wait's deadline is opt-in ----------------------------------------
def _burst(capacity: int, n: int) -> tuple[int, list[int], list[RouterError]]:
    """n requests arrive at once, without a deadline, while a head holds its turn: how many the
    queue held (the head included), the admission order, and the refusals."""
    async def run():
        queue = AdmissionQueue(capacity)
        head_in, release = asyncio.Event(), asyncio.Event()
        admitted: list[int] = []
        refused: list[RouterError] = []

        async def one(i: int) -> None:
            try:
                async with queue.turn(None):
                    if i == 0:
                        head_in.set()
                        await release.wait()
                    admitted.append(i)
            except RouterError as exc:
                refused.append(exc)
        tasks = [asyncio.create_task(one(0))]
        await head_in.wait()
        tasks += [asyncio.create_task(one(i)) for i in range(1, n + 1)]
        await _until(lambda: len(queue) + len(refused) == n + 1, "every arrival queued or refused")
        held = len(queue)
        release.set()
        await asyncio.gather(*tasks)
        return held, admitted, refused
    return asyncio.run(run())


def test_vllm_bench_serves_default_burst_waits_and_the_old_bound_refused_most_of_it() -> None:
    """vllm bench serve sends its 1,000 requests at once: with the default bound every one waits
    (and is admitted in arrival order); under the old default (256) 744 were refused at once. The
    refusal names the limit and its flag."""
    default = GenerationOptions().max_queued_requests
    assert default >= 1000
    held, admitted, refused = _burst(default, 1000)
    assert held == 1001 and admitted == list(range(1001)) and not refused
    held, admitted, refused = _burst(256, 1000)
    assert held == 257 and len(admitted) == 257 and len(refused) == 744
    assert all(e.code == "RESOURCE_EXHAUSTED" and "max_queued_requests=256, set by --max-queued-requests"
               in e.message and e.retry_after_s for e in refused), refused[0].message


def test_a_wait_without_a_deadline_ends_at_its_turn_or_when_its_caller_goes() -> None:
    """No timeout: a waiter waits for its turn however long (no timer at all), and a waiter whose
    caller went away (its task cancelled: a client that disconnected) leaves no hole."""
    async def run():
        queue = AdmissionQueue(8)
        head_in, release = asyncio.Event(), asyncio.Event()
        order: list[str] = []
        remaining: list[float | None] = []

        async def one(name: str) -> None:
            async with queue.turn(None) as turn:
                remaining.append(turn.remaining())
                if name == "head":
                    head_in.set()
                    await release.wait()
                order.append(name)
        head = asyncio.create_task(one("head"))
        await head_in.wait()
        gone, stays = asyncio.create_task(one("gone")), asyncio.create_task(one("stays"))
        await _until(lambda: len(queue) == 3, "two waiting")
        gone.cancel()
        await _until(lambda: len(queue) == 2, "the cancelled waiter out of the queue")
        release.set()
        await asyncio.gather(head, stays)
        return order, remaining, len(queue), gone.cancelled()
    order, remaining, left, cancelled = asyncio.run(run())
    assert order == ["head", "stays"] and remaining == [None, None] and left == 0 and cancelled


def test_the_queues_counts_match_its_waiters_through_arrivals_refusals_cancellations_and_turns() -> None:
    """len() and the bound's count are kept as waiters come and go (no scan per arrival): after
    every step of a random mix (priorities, moving requests, evictions by a higher class,
    refusals, cancelled waiters, heads finishing) they equal what a scan of the waiters gives."""
    import random
    from pdserve.services.router.admission import Ticket

    async def run():
        rng, queue = random.Random(7), AdmissionQueue(6)
        tasks: list[asyncio.Task] = []
        head_done: list[asyncio.Event] = []   # the current head's
        seen: collections.Counter[str] = collections.Counter()

        async def one(ticket: Ticket) -> None:
            try:
                async with queue.turn(None, ticket):
                    seen["admitted"] += 1
                    head_done[:] = [asyncio.Event()]
                    await head_done[0].wait()
            except RouterError as exc:
                seen["evicted" if "took this one's place" in exc.message else "refused"] += 1

        def scanned() -> tuple[int, int]:
            held = [w for w in (*queue._waiting, *queue._aside) if not w.gone]
            return len(held) + (queue._head is not None), sum(not w.ticket.moved for w in held)
        for _ in range(1000):
            op = rng.random()
            if op < 0.5:
                tasks.append(asyncio.create_task(one(Ticket(rng.randrange(3), rng.choice("abc"),
                                                            moved=rng.random() < 0.05))))
            elif op < 0.6 and tasks:
                rng.choice(tasks).cancel()
            elif head_done:
                head_done[0].set()
            for _ in range(3):
                await asyncio.sleep(0)
            assert (len(queue), queue._live()) == scanned()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(queue), queue._live(), seen
    left, live, seen = asyncio.run(run())
    assert (left, live) == (0, 0)
    assert min(seen["admitted"], seen["refused"], seen["evicted"]) >= 10, seen   # every path was taken


PROMPT = list(range(100, 124))   # 3 blocks of 8


@contextlib.asynccontextmanager
async def _full_decode_worker(decode_free: int = 0, prefill_queued: int = 0, **options):
    """A router (Generator) over 1 prefill + 1 decode worker whose status the test writes: by
    default the decode worker has no free block, so every request waits in the admission queue."""
    pool = WorkerPool(["127.0.0.1:11"], ["127.0.0.1:21"], [])
    for w in pool.workers:
        prefill = w.role == "prefill"
        w.status = worker_pb2.WorkerStatus(block_size=8, num_total_blocks=64, max_num_batched_tokens=2048,
                                           num_free_blocks=64 if prefill else decode_free,
                                           num_queued_prompt_tokens=prefill_queued if prefill else 0)
        w.connected = True
    try:
        yield Generator(pool, GenerationOptions(**options), RouterMetrics()), pool.of_role("decode")[0]
    finally:
        await pool.close()


async def _request(router: Generator, rid: str, deadline: float | None = None) -> RouterError:
    """One request to its end, which can only be an error here (with its time in .waited)."""
    t0 = time.monotonic()
    try:
        async for _ in router.generate(rid, PROMPT, SamplingParams(max_tokens=4), deadline=deadline):
            raise AssertionError("a token from a full decode worker")
    except RouterError as exc:
        exc.waited = time.monotonic() - t0
        return exc
    raise AssertionError("ended without an error")


def test_by_default_a_burst_waits_for_capacity_holding_nothing_until_its_clients_go() -> None:
    """300 requests at once (past the old bound of 256), a decode worker with no room: by default
    none is refused and none times out; while they wait, none holds a decode slot or asked a
    worker for KV; when their clients go (tasks cancelled) they leave the queue and the router."""
    async def run():
        async with _full_decode_worker() as (router, decode):
            tasks = [asyncio.create_task(_request(router, f"r{i}")) for i in range(300)]
            await _until(lambda: len(router.admission) == 300, "all 300 queued", yields=1000)
            await asyncio.sleep(0.3)   # kept: long enough for a timer, were there one, to fire
            waiting = (len(router.admission), sum(t.done() for t in tasks), decode.inflight,
                       sum(len(g.workers) for g in router.active.values()))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return waiting, len(router.admission), len(router.active)
    waiting, queued_after, active_after = asyncio.run(run())
    assert waiting == (300, 0, 0, 0)
    assert queued_after == 0 and active_after == 0


def test_past_the_count_a_burst_is_refused_at_once_naming_the_limit() -> None:
    async def run():
        async with _full_decode_worker(max_queued_requests=3) as (router, _):
            tasks = [asyncio.create_task(_request(router, f"r{i}")) for i in range(6)]
            await _until(lambda: len(router.admission) == 4 and sum(t.done() for t in tasks) == 2,
                         "the head and 3 waiting; 2 refused", yields=1000)
            refused = [t.result() for t in tasks if t.done()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return refused
    refused = asyncio.run(run())
    assert len(refused) == 2
    for err in refused:
        assert err.code == "RESOURCE_EXHAUSTED" and err.retry_after_s, err.message
        assert "queue is full" in err.message and "max_queued_requests=3, set by --max-queued-requests" in err.message


def test_queue_timeout_s_and_the_clients_deadline_still_end_a_wait() -> None:
    """Opt-in, the old behaviour: with queue_timeout_s a request that found no decode capacity in
    time is refused, saying which limit ended it; without it the client's own deadline (gRPC)
    ends the wait just before it passes."""
    async def run():
        async with _full_decode_worker(queue_timeout_s=0.2) as (router, _):
            timed_out = await asyncio.gather(*(_request(router, f"t{i}") for i in range(3)))
        async with _full_decode_worker() as (router, _):
            own = await _request(router, "own", deadline=time.monotonic() + 1.3)   # its margin: 1 s before
        return timed_out, own
    timed_out, own = asyncio.run(run())
    for err in timed_out:
        assert err.code == "RESOURCE_EXHAUSTED" and "no decode capacity" in err.message, err.message
        assert "queue_timeout_s=0.2, set by --queue-timeout-s" in err.message and err.retry_after_s
        assert 0.15 <= err.waited < 2.0
    assert own.code == "RESOURCE_EXHAUSTED" and "the request's own deadline" in own.message, own.message
    assert 0.2 <= own.waited < 1.3


def test_a_backlogged_prefill_worker_keeps_requests_in_the_router_queue_holding_no_kv() -> None:
    """The decode worker has room, but the prefill worker has PREFILL_AHEAD_S of prompts queued
    (by its learned step costs): the head does not reserve decode KV (its reservation would wait
    there, and lapse at the decode worker's lease cap under a long backlog); it reserves once the
    backlog shrinks."""
    from pdserve.services.router.placement import PREFILL_AHEAD_S

    async def run():
        async with _full_decode_worker(decode_free=64, prefill_queued=2 * 2048,
                                       disaggregation="always") as (router, decode):   # the remote route's gate
            prefill = router.pool.of_role("prefill")[0]
            prefill.status.step_ms_per_token = PREFILL_AHEAD_S * 1e3 / 2048   # two steps: twice the limit
            reserved = asyncio.Event()

            class Decode:   # the decode worker's Reserve, recorded (and never answered)
                async def Reserve(self, request, **kwargs):
                    reserved.set()
                    await asyncio.Event().wait()
            decode.decode = Decode()
            task = asyncio.create_task(_request(router, "r"))
            await _until(lambda: len(router.admission) == 1, "the request at the head")
            await asyncio.sleep(0.2)   # kept: time to reserve, were it allowed
            held = (reserved.is_set(), len(router.admission))
            prefill.status.num_queued_prompt_tokens = 2048 // 4   # the backlog drains to a fraction of the limit
            router.pool.notify()
            await asyncio.wait_for(reserved.wait(), 5.0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return held
    assert asyncio.run(run()) == (False, 1)


def test_queue_timeout_s_zero_or_none_means_no_limit_and_a_negative_one_is_refused() -> None:
    assert GenerationOptions().queue_timeout_s is None
    assert GenerationOptions(queue_timeout_s=0).queue_timeout_s is None
    assert GenerationOptions(queue_timeout_s=30).queue_timeout_s == 30
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="queue_timeout_s"):
            GenerationOptions(queue_timeout_s=bad)
