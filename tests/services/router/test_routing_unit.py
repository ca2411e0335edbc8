"""Route choice over a pool of workers whose status the test writes (no worker process): the
kv-aware policy follows the prefix cache, the load policy the requests in flight, a worker the
request left after a fault is avoided while another serves, a role with no healthy worker
raises NoWorker, and when a prefill worker counts as backlogged (reservations then wait)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from pdserve.services.router.placement import Placement
from pdserve.services.router.prefix_index import request_keys
from pdserve.services.router.worker_pool import NoWorker, WorkerPool
from pdserve.v1 import worker_pb2

PROMPT = list(range(100, 164))   # 8 blocks of 8


@contextlib.contextmanager
def _pool(prefill: list[str], decode: list[str], colocated: list[str] = ()):
    """A pool whose workers report the same status (their channels need a current event loop)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pool = WorkerPool(prefill, decode, list(colocated))
    for w in pool.workers:
        w.status = worker_pb2.WorkerStatus(block_size=8, num_total_blocks=256, num_free_blocks=256,
                                           step_base_ms=5.0, step_ms_per_token=0.05, decode_ms_per_seq=0.1)
        w.connected = True
    try:
        yield pool
    finally:
        loop.run_until_complete(pool.close())
        asyncio.set_event_loop(None)
        loop.close()


@pytest.fixture
def pool():
    with _pool(["127.0.0.1:11"], ["127.0.0.1:21", "127.0.0.1:22"]) as pool:
        yield pool


def _decode(pool: WorkerPool, i: int):
    return pool.of_role("decode")[i]


def test_kv_aware_routing_follows_the_cached_prefix(pool: WorkerPool) -> None:
    keys = request_keys(PROMPT, 8)
    holder = _decode(pool, 1)
    holder.index.apply(False, keys, ())
    routes = Placement(pool, "kv-aware").decode_routes(keys, len(PROMPT), 16)
    assert routes[0].decode is holder and routes[0].decode_cached_blocks == len(keys)
    assert routes[1].decode_cached_blocks == 0 and routes[0].cost < routes[1].cost


def test_kv_aware_prefill_goes_where_the_prompt_is_cached() -> None:
    with _pool(["127.0.0.1:11", "127.0.0.1:12"], ["127.0.0.1:21"]) as pool:
        keys = request_keys(PROMPT, 8)
        holder = pool.of_role("prefill")[1]
        holder.index.apply(False, keys, ())
        placement = Placement(pool, "kv-aware")
        assert placement.pick_prefill(keys, len(PROMPT))[0] is holder
        assert placement.uncached(holder, keys, len(PROMPT)) == 1   # at least one token is computed


def test_load_routing_ignores_the_cache_and_takes_the_least_busy(pool: WorkerPool) -> None:
    keys = request_keys(PROMPT, 8)
    _decode(pool, 0).index.apply(False, keys, ())
    _decode(pool, 0).inflight = 3
    routes = Placement(pool, "load").decode_routes(keys, len(PROMPT), 16)
    assert routes[0].decode is _decode(pool, 1)
    assert all(r.decode_cached_blocks == 0 for r in routes)   # the load policy does not look


def test_a_worker_left_after_a_fault_is_avoided_while_another_serves(pool: WorkerPool) -> None:
    keys = request_keys(PROMPT, 8)
    holder = _decode(pool, 0)
    holder.index.apply(False, keys, ())
    placement = Placement(pool, "kv-aware")
    assert placement.decode_routes(keys, len(PROMPT), 16, exclude={holder.address})[0].decode is not holder
    _decode(pool, 1).connected = False
    # the only healthy one: taken again rather than none
    assert placement.decode_routes(keys, len(PROMPT), 16, exclude={holder.address})[0].decode is holder


def test_no_healthy_worker_of_a_role_raises_no_worker(pool: WorkerPool) -> None:
    for w in pool.of_role("decode"):
        w.connected = False
    with pytest.raises(NoWorker) as err:
        Placement(pool).decode_routes([], 10, 16)
    assert err.value.role == "decode"
    pool.of_role("prefill")[0].status = worker_pb2.WorkerStatus(draining=True)
    with pytest.raises(NoWorker):
        Placement(pool).pick_prefill([], 10)


def test_the_remote_route_is_always_taken_unless_conditional(pool: WorkerPool) -> None:
    routes = Placement(pool, "kv-aware", "always").decode_routes([], len(PROMPT), 16)
    assert not any(r.local for r in routes) and all(r.threshold_tokens is None for r in routes)
    conditional = Placement(pool, "kv-aware", "conditional").decode_routes([], len(PROMPT), 16)
    assert all(r.local_ms > 0 and r.threshold_tokens is not None for r in conditional)
    assert all(r.local == (r.local_ms < r.remote_ms) for r in conditional)


@pytest.mark.parametrize("routing", ["kv-aware", "load"])
def test_a_colocated_member_among_prefill_and_decode_workers_prefills_its_own_prompts(routing: str) -> None:
    """A worker switched to colocated in a disaggregated deployment is a decode candidate whose
    route is always local; with no prefill worker healthy, it is the only route offered (the
    decode worker needs one); with none of it either, the remote route is offered all the same:
    a request reserves there and waits for its prefill worker outside the admission queue."""
    with _pool(["127.0.0.1:11"], ["127.0.0.1:21"], ["127.0.0.1:31"]) as pool:
        assert not pool.colocated and pool.serving
        both = pool.of_role("both")[0]
        assert both in pool.healthy("decode") and both not in pool.healthy("prefill")
        placement = Placement(pool, routing)
        routes = {r.decode.address: r for r in placement.decode_routes(request_keys(PROMPT, 8), len(PROMPT), 16)}
        assert routes["127.0.0.1:31"].local and not routes["127.0.0.1:21"].local
        pool.of_role("prefill")[0].connected = False
        routes = placement.decode_routes(request_keys(PROMPT, 8), len(PROMPT), 16)
        assert [r.decode for r in routes] == [both] and pool.serving
        both.connected = False
        assert not pool.serving and pool.outage_started("decode") is None   # the decode worker is healthy
        routes = placement.decode_routes(request_keys(PROMPT, 8), len(PROMPT), 16)
        assert [r.decode.address for r in routes] == ["127.0.0.1:21"] and not routes[0].local
        with pytest.raises(NoWorker) as err:
            placement.pick_prefill(request_keys(PROMPT, 8), len(PROMPT))
        assert err.value.role == "prefill"


@pytest.mark.parametrize("routing", ["kv-aware", "load"])
def test_a_prefill_worker_is_backlogged_past_its_seconds_of_queued_prompts(pool, routing) -> None:
    """Never under one step of queued prompt tokens (it would idle); past that when its learned
    step costs price the queue at PREFILL_AHEAD_S or more (a backlog that would outlast a tenth of
    the decode workers' lease cap), however few or many steps that is: a worker with a small chunk
    budget still takes a queue of prompts."""
    from pdserve.services.router.placement import PREFILL_AHEAD_S
    placement = Placement(pool, routing)
    prefill = pool.of_role("prefill")[0]
    budget = prefill.status.max_num_batched_tokens or 2048

    def backlogged(queued: int, ms_per_token: float) -> bool:
        prefill.status.num_queued_prompt_tokens, prefill.status.step_ms_per_token = queued, ms_per_token
        return placement.prefill_backlogged(request_keys(PROMPT, 8), len(PROMPT))
    slow = 2 * PREFILL_AHEAD_S * 1e3 / budget   # a step's worth of tokens takes twice PREFILL_AHEAD_S
    assert not backlogged(budget - 1, slow) and not backlogged(0, slow)
    assert backlogged(budget, slow) and not backlogged(budget, 0.05)
    assert not backlogged(20 * budget, 0.05)   # many steps, but seconds of work: taken
    at_limit = PREFILL_AHEAD_S * 1e3 / 0.05    # tokens that take PREFILL_AHEAD_S at 0.05 ms a token
    assert backlogged(int(at_limit), 0.05) and not backlogged(int(0.9 * at_limit), 0.05)
    prefill.status.num_queued_prompt_tokens = 0
    prefill.inflight_prompt_tokens = int(at_limit)   # routed there, not yet in its status
    assert placement.prefill_backlogged([], len(PROMPT))
    prefill.connected = False
    assert not placement.prefill_backlogged([], len(PROMPT))   # none healthy: the route waits for one anyway
