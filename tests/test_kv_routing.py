"""KV-aware routing and conditional disaggregation.

Units: the prefix-cache event log, the router's prefix index, the step-cost fit, the cost
model's threshold. End to end over real processes (router + 1 prefill + 2 decode workers, real
gRPC on loopback): requests follow the decode worker that holds their prefix, with greedy
tokens unchanged; an index that is wrong (every key it holds is stale) still gives the right
tokens; conditional disaggregation prefills locally on an idle decode worker and remotely
when sequences decode there.
"""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager, prompt_block_hashes
from engine.kv_events import KVEventLog
from engine.sequence import Sequence
from engine.step_cost import StepCost
from services.client import AsyncClient
from services.cost_model import CostModel, Load, StepCostView
from services.kv_index import PrefixIndex
from tests.conftest import random_prompts
from tests.serving import metric, scrape, start_cluster, worker_status, workers

BS = 8
ENGINE_ARGS = ["--block-size", str(BS), "--num-kv-blocks", "512", "--dtype", "float32"]


# ---------------------------------------------------------------- units


def test_event_log_net_changes_and_snapshot_after_a_gap() -> None:
    log = KVEventLog(window=4)
    first = log.read(None, lambda: [7])
    assert first.reset and first.stored == [7]
    log.stored(1)
    log.stored(2)
    log.removed(1)
    batch = log.read(first.cursor, lambda: [])
    assert not batch.reset and batch.stored == [2] and batch.removed == [1]
    for k in range(10, 16):   # more than the window: a reader at batch.cursor fell behind
        log.stored(k)
    late = log.read(batch.cursor, lambda: [2, 10])
    assert late.reset and late.stored == [2, 10]
    assert not log.read(late.cursor, lambda: [])


def test_block_manager_reports_keys_stored_when_computed_and_evicted() -> None:
    log = KVEventLog()
    bm = BlockManager(num_blocks=4, block_size=2, events=log)
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), num_prompt_tokens=5)
    bm.allocate(seq)
    keys = prompt_block_hashes(seq.token_ids, 2)
    assert not log.read(0, lambda: [])        # registered, not computed: a router must not count on them
    assert bm.computed_keys() == []
    seq.num_computed_tokens = 2
    bm.mark_computed(seq)
    assert log.read(0, lambda: []).stored == keys[:1]
    seq.num_computed_tokens = 5
    bm.mark_computed(seq)
    batch = log.read(0, lambda: [])
    assert batch.stored == keys and not batch.removed and bm.computed_keys() == keys
    bm.free(seq)                              # freed computed blocks stay findable
    assert not log.read(batch.cursor, lambda: [])
    other = Sequence("b", [9] * 8, SamplingParams(max_tokens=1), num_prompt_tokens=8)
    bm.allocate(other)                        # needs every block: the cached ones are reused
    evicted = log.read(batch.cursor, lambda: [])
    assert set(keys) <= set(evicted.removed)


def test_prefix_index_matches_leading_blocks_and_stays_bounded() -> None:
    index = PrefixIndex(max_keys=3)
    index.apply(True, [1, 2, 3], [])
    assert index.matched_blocks([1, 2, 3, 4]) == 3
    assert index.matched_blocks([2, 3]) == 2 and index.matched_blocks([9, 1]) == 0
    index.apply(False, [], [2])
    assert index.matched_blocks([1, 2, 3]) == 1
    index.note_routed([5, 6, 7])              # bounded: the least recently touched go first
    assert len(index) == 3 and 1 not in index and 7 in index
    index.apply(True, [], [])
    assert len(index) == 0


def test_step_cost_fit_recovers_base_and_slope() -> None:
    cost = StepCost()
    assert cost.coefficients() == (0.0, 0.0)
    for tokens in [1, 5, 17, 64, 3, 128, 40, 2, 90] * 10:
        cost.observe(tokens, 2.0 + 0.05 * tokens)
    base, per_token = cost.coefficients()
    assert base == pytest.approx(2.0, rel=1e-6) and per_token == pytest.approx(0.05, rel=1e-6)
    flat = StepCost()
    for _ in range(10):
        flat.observe(8, 4.0)                  # no spread: everything per token
    assert flat.coefficients() == (0.0, 0.5)


def test_threshold_is_where_local_and_remote_cost_the_same() -> None:
    model = CostModel(itl_weight=1.0)
    model.observe_transfer(4, 2.0)
    decode, prefill = StepCostView(1.0, 0.05, 512, True, 0.05), StepCostView(1.0, 0.05, 2048, True, 0.05)
    decode_load, prefill_load = Load(0, 3), Load(3000, 0)
    u = model.threshold_tokens(decode, decode_load, prefill, prefill_load, block_size=16)
    assert 0 < u < math.inf
    local = model.local_ms(decode, decode_load, round(u))
    remote = model.remote_ms(prefill, prefill_load, round(u), shipped_blocks=round(u) / 16)
    assert local == pytest.approx(remote, rel=0.01)
    assert model.local_ms(decode, decode_load, round(u / 2)) < model.remote_ms(prefill, prefill_load, round(u / 2),
                                                                               round(u / 2) / 16)
    # a slower prefill worker raises the threshold; an idle one with an idle decode worker: never local
    slow = model.threshold_tokens(decode, decode_load, StepCostView(1.0, 0.5, 2048, True, 0.05), prefill_load, 16)
    assert slow > u
    assert model.threshold_tokens(decode, decode_load, prefill, Load(0, 0), 16) == 0.0
    assert model.threshold_tokens(decode, Load(0, 0), prefill, Load(0, 0), 16) == math.inf


def _pool_with_statuses(routing: str, disaggregation: str, itl_weight: float = 1.0):
    """A real WorkerPool and Placement over workers that are never contacted: their statuses and
    prefix indexes are set as their streams would set them."""
    from pdserve.v1 import worker_pb2
    from services.routing import Placement
    from services.worker_pool import WorkerPool

    pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2", "127.0.0.1:3"], [])
    for w in pool.workers:
        w.connected = True
        w.status = worker_pb2.WorkerStatus(block_size=4, num_total_blocks=100, num_free_blocks=100,
                                           step_base_ms=1.0, step_ms_per_token=0.1, max_num_batched_tokens=256)
    return pool, Placement(pool, routing, disaggregation, CostModel(itl_weight))


def test_placement_prefers_the_decode_worker_holding_the_prefix() -> None:
    from services.kv_index import request_keys

    async def run():
        prompt = list(range(2, 42))                          # 10 full blocks of 4
        keys = request_keys(prompt, 4)
        pool, kv_aware = _pool_with_statuses("kv-aware", "always")
        d1, d2 = pool.of_role("decode")
        d2.index.apply(True, keys[:8], [])
        routes = kv_aware.decode_routes(keys, len(prompt), max_tokens=16)
        assert routes[0].decode is d2 and routes[0].decode_cached_blocks == 8 and not routes[0].local
        d2.inflight = 5                                      # ...unless it is much busier
        assert kv_aware.decode_routes(keys, len(prompt), max_tokens=16)[0].decode is d1
        d2.inflight = 0
        _, load = _pool_with_statuses("load", "always")
        for a, b in zip(load.pool.workers, pool.workers):
            a.index = b.index
        assert load.decode_routes(keys, len(prompt), max_tokens=16)[0].decode is load.pool.of_role("decode")[0]
        await pool.close()
        await load.pool.close()
    asyncio.run(run())


def test_placement_prefills_locally_only_when_it_pays() -> None:
    async def run():
        pool, placement = _pool_with_statuses("kv-aware", "conditional", itl_weight=1.0)
        prefill = pool.of_role("prefill")[0]
        idle = placement.decode_routes([], 200, max_tokens=16)[0]
        assert idle.local and idle.threshold_tokens == math.inf   # nobody decodes: local at any length
        for d in pool.of_role("decode"):
            d.status.num_running = 8
        assert not placement.decode_routes([], 200, max_tokens=16)[0].local   # 8 running: ship it
        prefill.status.num_queued_prompt_tokens = 4000     # a long queue at the prefill worker: short ones stay
        short, long = (placement.decode_routes([], n, max_tokens=16)[0] for n in (32, 2000))
        assert short.local and not long.local
        assert 32 < short.threshold_tokens < 2000
        prefill.status.step_ms_per_token = 0.2              # a slower prefill worker: the threshold moves up
        assert placement.decode_routes([], 32, max_tokens=16)[0].threshold_tokens > short.threshold_tokens
        await pool.close()
    asyncio.run(run())


# ---------------------------------------------------------------- end to end


PREFIX_A, PREFIX_B = random_prompts(2, 64, 64, seed=5)      # 8 full blocks each
SUFFIXES = random_prompts(6, 5, 12, seed=6)
MAX_NEW = 8


@pytest.fixture(scope="module")
def offline(tiny_qwen3: str):
    llm = LLM(tiny_qwen3, dtype="float32", block_size=BS, num_kv_blocks=512)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                          ignore_eos=True))]
    return run


async def _one(client: AsyncClient, prompt: list[int], max_tokens: int = MAX_NEW):
    return await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _first_token_then(client: AsyncClient, prompt: list[int], max_tokens: int, started: asyncio.Event):
    """Stream a long request; set started at its first token."""
    tokens = []
    async for msg in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        tokens.extend(msg.token_ids)
        started.set()
    return tokens


def _wait_idle(cluster, timeout: float = 30.0) -> None:
    """Every decode worker with nothing running or reserved, then a status interval more."""
    deadline = time.monotonic() + timeout
    while any(st.num_running or st.num_waiting or st.num_reserved
              for st in (worker_status(cluster, a) for a in workers(cluster, "decode"))):
        if time.monotonic() > deadline:
            raise AssertionError("decode workers still busy")
        time.sleep(0.02)
    time.sleep(0.3)   # > the workers' status interval: the router has seen it


def test_requests_follow_the_decode_worker_holding_their_prefix(tiny_qwen3: str, offline) -> None:
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=2, engine_args=ENGINE_ARGS,
                            router_args=["--routing", "kv-aware"])
    try:
        async def run():
            async with AsyncClient(cluster.router_address, timeout=60) as client:
                # A lands on one decode worker; B, sent while A decodes, on the other (load)
                started = asyncio.Event()
                a = asyncio.create_task(_first_token_then(client, PREFIX_A + SUFFIXES[0], 48, started))
                await asyncio.wait_for(started.wait(), 30)
                b = await _one(client, PREFIX_B + SUFFIXES[1])
                await a
                # then, one at a time, each once both workers are idle in the router's view too (its
                # status streams): each follows its prefix, whatever the learned costs say of load
                follow = []
                for p, s in ((PREFIX_A, SUFFIXES[2]), (PREFIX_B, SUFFIXES[3]), (PREFIX_A, SUFFIXES[4]),
                             (PREFIX_B, SUFFIXES[5])):
                    await asyncio.to_thread(_wait_idle, cluster)
                    follow.append(await _one(client, p + s))
                return b, follow
        b, follow = asyncio.run(run())
        prompts = [PREFIX_A + SUFFIXES[2], PREFIX_B + SUFFIXES[3], PREFIX_A + SUFFIXES[4], PREFIX_B + SUFFIXES[5]]
        assert [o.token_ids for o in follow] == offline(prompts)
        assert b.token_ids == offline([PREFIX_B + SUFFIXES[1]])[0]
        for o in follow:
            assert o.timings["prefill_route"] == "remote"
            assert o.timings["decode_cached_tokens"] == len(PREFIX_A), o.timings   # the prefix was not shipped
        # both decode workers served, and each one's prefix hits come from its own prefix
        decode_hits = [metric(scrape(p.metrics_address), "pdserve:prefix_cache_hits_total")
                       for p in cluster.processes if p.name.startswith("decode")]
        assert all(h >= 2 * len(PREFIX_A) for h in decode_hits), decode_hits
    finally:
        cluster.stop()


def test_stale_index_costs_a_miss_not_a_wrong_token(tiny_qwen3: str, offline) -> None:
    """Workers without prefix caching never hold a prefix, but the router notes every routed
    request's keys: its index says the prefix is there (stale, always). Routing acts on it, the
    decode worker's reservation says what it really lacks, every block is shipped, and the
    tokens are right."""
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1,
                            engine_args=[*ENGINE_ARGS, "--no-enable-prefix-caching"],
                            router_args=["--routing", "kv-aware", "--disaggregation", "always"])
    try:
        prompts = [PREFIX_A + s for s in SUFFIXES[:4]]

        async def run():
            async with AsyncClient(cluster.router_address, timeout=60) as client:
                return [await _one(client, p) for p in prompts]
        outs = asyncio.run(run())
        assert [o.token_ids for o in outs] == offline(prompts)
        assert all(o.usage["cached_tokens"] == 0 and o.timings["decode_cached_tokens"] == 0 for o in outs)
        assert all(o.timings["prefill_route"] == "remote" and o.timings["kv_bytes"] > 0 for o in outs)
    finally:
        cluster.stop()


def test_conditional_disaggregation_decides_both_ways(tiny_qwen3: str, offline) -> None:
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS,
                            router_args=["--disaggregation", "conditional", "--itl-weight", "1000"])
    try:
        long_prompt = random_prompts(1, 300, 300, seed=9)[0]
        short_prompt = SUFFIXES[0]

        async def run():
            async with AsyncClient(cluster.router_address, timeout=60) as client:
                idle = await _one(client, short_prompt)          # nothing decodes: local costs no one
                started = asyncio.Event()
                runner = asyncio.create_task(_first_token_then(client, PREFIX_A, 200, started))
                await asyncio.wait_for(started.wait(), 30)
                busy = await _one(client, long_prompt)           # a long local chunk would stall the runner
                await runner
                return idle, busy, await runner
        idle, busy, runner_tokens = asyncio.run(run())
        assert idle.timings["prefill_route"] == "local", idle.timings
        assert idle.timings["kv_bytes"] == 0
        assert busy.timings["prefill_route"] == "remote", busy.timings
        assert busy.timings["kv_bytes"] > 0
        assert busy.timings["estimated_local_ms"] > busy.timings["estimated_remote_ms"] > 0
        assert busy.timings["local_prefill_threshold_tokens"] is not None
        assert busy.timings["local_prefill_threshold_tokens"] < len(long_prompt)
        assert [idle.token_ids, busy.token_ids] == offline([short_prompt, long_prompt])
        router = next(p for p in cluster.processes if p.name == "router")
        samples = scrape(router.metrics_address)
        assert metric(samples, "pdserve:prefill_route_total") >= 3
        assert any(k.startswith("pdserve:router_local_prefill_threshold_tokens{") for k in samples)
        assert metric(samples, "pdserve:router_est_step_ms_per_token") > 0
        assert len(runner_tokens) == 200
    finally:
        cluster.stop()
