"""KV-aware routing and conditional disaggregation.

Units: the prefix-cache event log (keys published when computed), the router's prefix index
(keys routed there pending until reported), the step-cost fits (prompt steps by tokens, decode
steps by sequences; what a decode worker publishes), the transfer fit, the cost model's
threshold, cache affinity against decode load, the threshold following the prefill worker's
learned speed, and prompt chunks in steps that decode (fixed, and learned on a decode worker).
Decisions and counts only: step times are synthetic, never measured.

End to end over real processes (router + 1 prefill + 2 decode workers, real gRPC on loopback):
requests follow the decode worker that holds their prefix, and a burst sharing a new prefix
waits for its first request's blocks, with greedy tokens unchanged; an index that is wrong
(every key it holds is stale) still gives the right tokens; conditional disaggregation
prefills locally on an idle decode worker and remotely when sequences decode there.
"""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.block_manager import BlockManager, prompt_block_hashes
from pdserve.engine.kv.events import KVEventLog
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_cost import Load, StepCost, StepCostView, published_costs
from pdserve.services.client import AsyncClient
from pdserve.services.router.placement import CostModel
from pdserve.services.router.prefix_index import PrefixIndex
from pdserve.v1 import worker_pb2
from tests.conftest import random_prompts
from tests.e2e.test_membership import members
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


def test_prefix_index_keys_routed_are_pending_until_reported_or_settled() -> None:
    index = PrefixIndex(max_keys=8)
    index.apply(True, [1], [])
    index.note_routed([1, 2, 3])              # 1 is held; 2, 3 are on their way
    assert index.matched_blocks([1, 2, 3]) == 3 and index.pending_blocks([1, 2, 3]) == 2
    index.apply(False, [2], [])               # the worker computed 2
    assert index.pending_blocks([1, 2, 3]) == 1
    index.settle([3])                         # the request that noted 3 has its KV in place (or is gone)
    assert index.pending_blocks([1, 2, 3]) == 0 and index.matched_blocks([1, 2, 3]) == 3
    index.note_routed([4, 5])
    index.apply(False, [], [4])               # dropped: neither held nor pending
    assert index.matched_blocks([4, 5]) == 0 and index.pending_blocks([5]) == 1
    index.note_routed(range(10, 20))          # pushed out of the bounded index: forgotten
    assert index.pending_blocks([5]) == 0 and len(index) == 8
    index.note_routed([30])
    index.apply(True, [], [])
    assert index.pending_blocks([30]) == 0


def test_step_cost_fit_recovers_base_and_slope() -> None:
    cost = StepCost()
    assert cost.coefficients() == (0.0, 0.0)
    for tokens in [1, 5, 17, 64, 3, 128, 40, 2, 90] * 10:
        cost.observe(tokens, 2.0 + 0.05 * tokens)
    base, per_token = cost.coefficients()
    assert base == pytest.approx(2.0, rel=1e-6) and per_token == pytest.approx(0.05, rel=1e-6)
    flat = StepCost()
    for _ in range(10):
        flat.observe(8, 4.0)                  # no spread: everything per token, and no line
    assert flat.coefficients() == (0.0, 0.5) and flat.line() is None
    decode = StepCost(min_spread=1.0)         # decode batches of 1-4 sequences: a spread of 1 suffices
    for seqs in [2, 3] * 20:
        decode.observe(seqs, 20.0 + 5.0 * seqs)
    assert decode.line() is None
    for seqs in [1, 4] * 40:
        decode.observe(seqs, 20.0 + 5.0 * seqs)
    assert decode.line() == pytest.approx((20.0, 5.0))
    assert StepCost().line() is None


def test_decode_worker_publishes_no_prompt_token_cost_until_it_computes_a_prompt() -> None:
    """Decode-only steps tell nothing of a prompt token's cost: the worker publishes none (the
    router borrows its peers'), only the fixed part of a step and the per-sequence cost."""
    from types import SimpleNamespace

    from pdserve.v1 import worker_pb2

    engine = SimpleNamespace(step_cost=StepCost(), decode_step_cost=StepCost(min_spread=1.0))
    for seqs in [1, 2, 3, 4] * 30:
        engine.decode_step_cost.observe(seqs, 20.0 + 5.0 * seqs)
    base, per_token, per_seq = published_costs(engine.step_cost, engine.decode_step_cost)
    assert (base, per_token, per_seq) == pytest.approx((20.0, 0.0, 5.0))
    decode = worker_pb2.WorkerStatus(step_base_ms=base, step_ms_per_token=per_token, decode_ms_per_seq=per_seq)
    prefill = worker_pb2.WorkerStatus(step_base_ms=50.0, step_ms_per_token=1.5)
    view = CostModel.step_cost(decode, [decode, prefill])
    assert (view.base_ms, view.ms_per_token, view.ms_per_seq) == pytest.approx((20.0, 1.5, 5.0))
    assert not view.learned
    for tokens in [64, 16, 130, 40] * 10:   # then it prefills prompts locally: its own cost
        engine.step_cost.observe(tokens, 30.0 + 2.0 * tokens)
    assert published_costs(engine.step_cost, engine.decode_step_cost) == pytest.approx((30.0, 2.0, 5.0))


def test_transfer_cost_is_a_fixed_part_plus_a_part_per_block() -> None:
    model = CostModel()
    for blocks in [2, 18, 2, 5, 18, 1] * 5:
        model.observe_transfer(blocks, 30.0 + 0.5 * blocks)   # mostly the last send's round trip
    assert model.transfer_ms_per_block == pytest.approx(0.5) and model.transfer_base_ms == pytest.approx(30.0)
    assert model.transfer_ms(0) == 0.0 and model.transfer_ms(4) == pytest.approx(32.0)


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


def _pool_with_statuses(routing: str, disaggregation: str, itl_weight: float = 1.0, affinity_weight: float = 1.0,
                        tokens_left=lambda worker: []):
    """A real WorkerPool and Placement over workers that are never contacted: their statuses and
    prefix indexes are set as their streams would set them."""
    from pdserve.v1 import worker_pb2
    from pdserve.services.router.placement import Placement
    from pdserve.services.router.worker_pool import WorkerPool

    pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2", "127.0.0.1:3"], [])
    for w in pool.workers:
        w.connected = True
        w.status = worker_pb2.WorkerStatus(block_size=4, num_total_blocks=100, num_free_blocks=100,
                                           step_base_ms=1.0, step_ms_per_token=0.1, max_num_batched_tokens=256)
    return pool, Placement(pool, routing, disaggregation, CostModel(itl_weight, affinity_weight), tokens_left)


def test_placement_prefers_the_decode_worker_holding_the_prefix() -> None:
    from pdserve.services.router.prefix_index import request_keys

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


def test_a_prefix_stays_on_its_worker_until_the_extra_load_costs_more_than_the_prefix() -> None:
    """SGLang's balance threshold, in learned milliseconds: the worker holding 16 blocks of the
    prompt (64 tokens: 64 ms at the prefill worker's 1 ms per token) keeps it while its extra
    decode load (2 ms per sequence per step, 16 output tokens: 32 ms per sequence) costs less."""
    from pdserve.services.router.prefix_index import request_keys

    async def run():
        prompt = list(range(2, 82))                          # 20 full blocks of 4
        keys = request_keys(prompt, 4)
        left: dict[str, list[int]] = {}
        for weight, kept in ((1.0, [0, 1, 2]), (0.0, [0])):
            pool, placement = _pool_with_statuses("kv-aware", "always", affinity_weight=weight,
                                                  tokens_left=lambda w: left.get(w.address, []))
            pool.of_role("prefill")[0].status.step_ms_per_token = 1.0
            d1, d2 = pool.of_role("decode")
            for d in (d1, d2):
                d.status.decode_ms_per_seq = 2.0
            d2.index.apply(True, keys[:16], [])
            chosen = {}
            for extra in range(4):
                d2.status.num_running = extra
                chosen[extra] = placement.decode_routes(keys, len(prompt), max_tokens=16)[0].decode
            assert [n for n, d in chosen.items() if d is d2] == kept, (weight, chosen)
            # sequences about to finish share few steps with the new request: they weigh less
            d2.status.num_running = 3
            left[d2.address] = [1, 1, 1]
            assert (placement.decode_routes(keys, len(prompt), max_tokens=16)[0].decode is d2) == bool(weight)
            left.clear()
            await pool.close()
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


def test_the_local_prefill_threshold_follows_the_prefill_workers_learned_speed() -> None:
    """The prefill worker learns its step cost from its own steps (synthetic step times here: no
    clock) and publishes it; when its steps get slower, the threshold rises and a prompt that was
    shipped is prefilled on the decode worker instead."""
    from types import SimpleNamespace


    async def run():
        pool, placement = _pool_with_statuses("kv-aware", "conditional")
        prefill = pool.of_role("prefill")[0]
        for d in pool.of_role("decode"):
            d.status.num_running = 4
        engine = SimpleNamespace(step_cost=StepCost(), decode_step_cost=StepCost(min_spread=1.0))

        def prefill_steps(ms_per_token: float) -> None:
            for tokens in [64, 300, 128, 700] * 50:
                engine.step_cost.observe(tokens, 5.0 + ms_per_token * tokens)
            base, per_token, _ = published_costs(engine.step_cost, engine.decode_step_cost)
            prefill.status.step_base_ms, prefill.status.step_ms_per_token = base, per_token

        decisions, thresholds = [], []
        for ms_per_token in (0.1, 1.0, 0.1):
            prefill_steps(ms_per_token)
            decisions.append(placement.decode_routes([], 100, max_tokens=16)[0].local)
            thresholds.append(placement.threshold_now(pool.of_role("decode")[0]))
        assert decisions == [False, True, False]
        assert thresholds[0] < 100 < thresholds[1] and thresholds[2] == pytest.approx(thresholds[0], rel=0.05)
        await pool.close()
    asyncio.run(run())


def test_a_step_that_decodes_holds_at_most_the_prompt_chunk(tiny_qwen3: str) -> None:
    """--prompt-tokens-with-decodes: while sequences decode, a prompt is computed in chunks of at
    most that many tokens (alone, it takes the whole budget); greedy tokens are unchanged."""
    long_prompt = random_prompts(1, 120, 120, seed=11)[0]
    shorts = random_prompts(3, 4, 8, seed=12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = []
    for chunk in (None, 8):
        llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=128, schedule_policy="mixed",
                  prompt_tokens_with_decodes=chunk)
        engine = llm.engine
        for i, p in enumerate(shorts):
            engine.add_request(f"short{i}", p, params)
        engine.step()
        engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps = [t for t in engine.trace if "long" in t.request_ids and t.num_prefill_tokens]
        if chunk is None:
            assert max(t.num_prefill_tokens for t in steps) == 120
        else:
            assert all(t.num_prefill_tokens <= chunk for t in steps if t.num_decode_seqs) and len(steps) >= 15
        outputs.append(done)
        llm.close()
    assert outputs[0] == outputs[1]


def test_a_decode_worker_sizes_its_prompt_chunk_from_its_learned_step_costs(tiny_qwen3: str) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(tiny_qwen3, role="decode", dtype="float32", block_size=8,
                                                num_kv_blocks=64))
    try:
        assert engine.prompt_chunk_with_decodes() == 8           # nothing learned yet: one block
        for seqs in [1, 4] * 100:
            engine.decode_step_cost.observe(seqs, 10.0 + 2.0 * seqs)
        for tokens in [16, 64] * 50:
            engine.step_cost.observe(tokens, 5.0 + 0.25 * tokens)
        # half a decode step (10 + 2 x 1 sequence = 12 ms) of 0.25 ms prompt tokens
        assert engine.prompt_chunk_with_decodes() == 24
        both = LLMEngine(EngineConfig.from_kwargs(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=64))
        both.step()
        assert both.scheduler.prompt_tokens_with_decodes is None  # colocated: the whole step budget
        both.close()
    finally:
        engine.close()


# ---------------------------------------------------------------- end to end


PREFIX_A, PREFIX_B, PREFIX_C = random_prompts(3, 64, 64, seed=5)      # 8 full blocks each
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
    """Every decode worker with nothing running or reserved, in its own status and in the router's view
    (the last status it streamed from it: no request on it, every block free)."""
    deadline = time.monotonic() + timeout
    while any(st.num_running or st.num_waiting or st.num_reserved
              for st in (worker_status(cluster, a) for a in workers(cluster, "decode"))):
        if time.monotonic() > deadline:
            raise AssertionError("decode workers still busy")
        time.sleep(0.02)
    while not all(w.inflight == 0 and w.num_free_blocks == w.num_total_blocks > 0
                  for w in members(cluster).values() if w.role == worker_pb2.WORKER_ROLE_DECODE):
        if time.monotonic() > deadline:
            raise AssertionError(f"the router's view of the decode workers: {list(members(cluster).values())}")
        time.sleep(0.02)


def test_requests_follow_the_decode_worker_holding_their_prefix(tiny_qwen3: str, offline) -> None:
    # cache affinity weighed far above any load: the placements asserted below do not hang on
    # how this machine's noise shapes the learned step costs of a tiny model
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=2, engine_args=ENGINE_ARGS,
                            router_args=["--routing", "kv-aware", "--cache-affinity-weight", "1000"])
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
                # a burst sharing a new prefix: the first request puts it on a decode worker, the
                # others wait there until it is computed and share it instead of shipping it again
                burst = await asyncio.gather(*(_one(client, PREFIX_C + s) for s in SUFFIXES[:3]))
                return b, follow, burst
        b, follow, burst = asyncio.run(run())
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
        assert [o.token_ids for o in burst] == offline([PREFIX_C + s for s in SUFFIXES[:3]])
        assert sorted(o.timings["decode_cached_tokens"] for o in burst) == [0, len(PREFIX_C), len(PREFIX_C)]
        router = next(p for p in cluster.processes if p.name == "router")
        assert metric(scrape(router.metrics_address), "pdserve:router_prefix_waits_total") >= 1
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
