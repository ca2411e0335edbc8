"""Priority in the engine (engine/scheduler.py): the waiting queue admits the lowest priority value
first (FIFO within one), and a higher class that the full pool cannot hold preempts lower classes by
recompute, after which every request's greedy tokens equal those of a run alone. The scheduler's
rules on a real block manager without a model first, then the engine on the tiny model."""
from __future__ import annotations

import zlib

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.handoff import BlockMeta, HandoffState
from pdserve.engine.scheduler import Scheduler, StepTrace
from pdserve.engine.sequence import Sequence, SequenceStatus
from tests.conftest import assert_no_leak, random_prompts


def greedy(max_tokens: int, priority: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


# ---- the scheduler alone (block size 4, no model) -------------------------------------------------
def scheduler(blocks: int = 64, budget: int = 64, max_seqs: int = 8, held: frozenset[str] = frozenset()) -> Scheduler:
    config = EngineConfig(model="none", block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          schedule_policy="mixed")
    return Scheduler(config, BlockManager(blocks, 4), held=lambda rid: rid in held)


def seq(rid: str, n: int, priority: int = 0, base: int = 0) -> Sequence:
    return Sequence(rid, [base + i for i in range(n)], greedy(8, priority))


def step(s: Scheduler) -> StepTrace:
    """One step as the engine applies it (a token sampled at each prompt's end): what it did."""
    batch = s.schedule()
    assert batch is not None
    for q, n in zip(batch.seqs, batch.num_new_tokens):
        q.num_computed_tokens += n
        s.block_manager.mark_computed(q)
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(1)
            q.first_token_time = q.first_token_time or 1.0
    return s.trace(0, batch)


def waiting(s: Scheduler) -> list[str]:
    return [q.request_id for q in s.waiting]


def test_the_queue_orders_by_priority_fifo_within_one() -> None:
    s = scheduler()
    for rid, p in (("a", 1), ("b", 1), ("c", 0), ("d", 2), ("e", 0), ("f", -3)):
        s.add(seq(rid, 4, p))
    assert waiting(s) == ["f", "c", "e", "a", "b", "d"]
    same = scheduler()
    for rid in "xyz":
        same.add(seq(rid, 4, 5))
    assert waiting(same) == ["x", "y", "z"]


def test_a_preempted_sequence_waits_ahead_of_its_class_behind_higher_ones() -> None:
    s = scheduler(blocks=16, budget=64)
    s.add(seq("lo0", 24, 1))
    s.add(seq("lo1", 24, 1, base=100))
    step(s)
    s.add(seq("mid", 4, 1, base=300))
    s.add(seq("hi", 16, 0, base=200))    # 4 blocks + the watermark: 3 are free
    trace = step(s)
    assert trace.request_ids == ["lo0", "hi"] and trace.preempted == ["lo1"]   # the latest arrival
    assert waiting(s) == ["lo1", "mid"] and s.num_priority_preemptions == 1
    s.add(seq("top", 4, -1, base=400))
    assert waiting(s) == ["top", "lo1", "mid"]


def test_no_preemption_when_the_lower_classes_cannot_make_room() -> None:
    s = scheduler(blocks=16)
    s.add(seq("same", 36, 0))            # 9 blocks of the same class as the newcomer: never a victim
    s.add(seq("lo", 20, 1, base=100))    # 5 blocks: 2 left free
    step(s)
    s.add(seq("hi", 28, 0, base=200))    # 7 blocks: even with lo's 5 freed, 2 + 5 < 7 + the watermark
    step(s)
    assert s.num_preemptions == 0 and waiting(s) == ["hi"]


def test_a_sequence_the_kv_connector_holds_is_never_a_victim() -> None:
    s = scheduler(blocks=16, held=frozenset({"lo1"}))
    s.add(seq("lo0", 24, 1))
    s.add(seq("lo1", 24, 1, base=100))
    step(s)
    s.add(seq("hi", 16, 0, base=200))
    step(s)
    assert waiting(s) == ["lo0"] and [q.request_id for q in s.running] == ["lo1", "hi"]


def test_a_decode_out_of_blocks_preempts_the_lowest_class_even_one_scheduled_this_step() -> None:
    """lo (admitted first, so scheduled first) takes the pool's last block; two steps later hi needs
    a block: lo, already in that step's decodes, is taken out of it and preempted, not hi."""
    s = scheduler(blocks=5, budget=64)
    s.add(seq("lo", 6, 1))
    step(s)                               # lo: 2 blocks
    s.add(seq("hi", 5, 0, base=100))
    step(s)                               # hi: 2 blocks, 1 left
    assert [step(s).preempted for _ in range(3)] == [[], [], []]   # lo's 3rd block: the pool is full
    trace = step(s)
    assert trace.request_ids == ["hi"] and trace.preempted == ["lo"]
    assert s.waiting[0].status is SequenceStatus.WAITING and [q.request_id for q in s.running] == ["hi"]
    assert s.num_preemptions == 1 and s.num_priority_preemptions == 0


def test_equal_classes_keep_the_youngest_as_the_growth_victim() -> None:
    s = scheduler(blocks=4, budget=64)
    s.add(seq("a", 4, 3))
    s.add(seq("b", 4, 3, base=100))
    for _ in range(6):                    # 1 block each, then 2: the pool is full; a's 3rd takes b's
        step(s)
    assert waiting(s) == ["b"] and s.num_preemptions == 1


# ---- the engine on the tiny model ----------------------------------------------------------------
KW = dict(dtype="float32", block_size=8, max_num_batched_tokens=256, max_model_len=256)
PROMPTS = random_prompts(3, 24, 24, seed=31)    # 3 blocks each
LOW_NEW, HIGH_NEW = 40, 16                       # a low one grows to 8 blocks: two fill a pool of 16


def step_into(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    """One engine step, its new tokens collected per request."""
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def run_to_end(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        step_into(engine, tokens)


def alone(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The request's greedy tokens with nothing beside it (no preemption)."""
    llm = LLM(model, num_kv_blocks=64, **KW)
    return llm.generate([prompt], greedy(max_tokens))[0].token_ids


def fill_with_two_lows(engine: LLMEngine, priority: int, tokens: dict[str, list[int]]) -> None:
    """Two low-class sequences decode until the pool has fewer free blocks than a prompt needs."""
    engine.add_request("lo0", PROMPTS[0], greedy(LOW_NEW, priority))
    engine.add_request("lo1", PROMPTS[1], greedy(LOW_NEW, priority))
    while engine.stats()["num_free_blocks"] >= 4:   # 3 blocks + the watermark
        step_into(engine, tokens)
    assert engine.stats()["num_preemptions"] == 0


def test_waiting_requests_are_admitted_by_priority(tiny_qwen3: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, num_kv_blocks=64, max_num_seqs=1, prompt_order="fcfs", **KW))
    prompts = random_prompts(6, 5, 12, seed=32)
    engine.add_request("a", prompts[0], greedy(4, 1))
    engine.step()                                 # the batch is full
    engine.add_request("b", prompts[1], greedy(4, 1))
    engine.add_request("c", prompts[2], greedy(4, 0))
    for rid, p in zip("xyz", prompts[3:]):        # equal priorities: FIFO (prompt_order fcfs)
        engine.add_request(rid, p, greedy(4, 2))
    order: list[str] = []
    while engine.has_unfinished_requests():
        engine.step()
        order += [r for r in engine.trace[-1].request_ids if r not in order]
    assert order == ["a", "c", "b", "x", "y", "z"]


def test_shortest_prompt_order_keeps_classes_and_orders_within_one(tiny_qwen3: str) -> None:
    """The default order: classes first, then within one a burst's shorter prompts first."""
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, num_kv_blocks=64, max_num_seqs=1, **KW))
    assert engine.config.prompt_order == "shortest"
    prompts = random_prompts(4, 5, 12, seed=32)
    engine.add_request("a", prompts[0], greedy(4, 1))
    engine.step()                                 # the batch is full
    for rid, n in (("long", 40), ("short", 6), ("mid", 20)):
        engine.add_request(rid, prompts[1][:1] * n, greedy(4, 2))
    engine.add_request("urgent-long", prompts[2][:1] * 50, greedy(4, 0))
    order: list[str] = []
    while engine.has_unfinished_requests():
        engine.step()
        order += [r for r in engine.trace[-1].request_ids if r not in order]
    assert order == ["a", "urgent-long", "short", "mid", "long"]
    assert engine.stats()["num_preemptions"] == 0
    assert_no_leak(engine)


def test_a_higher_class_preempts_a_lower_one_and_every_token_stays_exact(tiny_qwen3: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, num_kv_blocks=16, **KW))
    tokens: dict[str, list[int]] = {}
    fill_with_two_lows(engine, 1, tokens)
    engine.add_request("hi", PROMPTS[2], greedy(HIGH_NEW, 0))
    step_into(engine, tokens)
    trace = engine.trace[-1]
    assert trace.preempted == ["lo1"] and "hi" in trace.request_ids   # the latest arrival of the lowest class
    assert engine.stats()["num_priority_preemptions"] == 1
    run_to_end(engine, tokens)
    stats = engine.stats()
    assert stats["num_preemptions"] >= 1 and stats["num_priority_preemptions"] >= 1
    finished = {rid: i for i, t in enumerate(engine.trace) for rid in t.request_ids}
    assert finished["hi"] < finished["lo1"]
    assert tokens == {"lo0": alone(tiny_qwen3, PROMPTS[0], LOW_NEW), "lo1": alone(tiny_qwen3, PROMPTS[1], LOW_NEW),
                      "hi": alone(tiny_qwen3, PROMPTS[2], HIGH_NEW)}
    assert_no_leak(engine)


def test_a_same_class_arrival_never_preempts(tiny_qwen3: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, num_kv_blocks=16, **KW))
    tokens: dict[str, list[int]] = {}
    fill_with_two_lows(engine, 1, tokens)
    engine.add_request("peer", PROMPTS[2], greedy(HIGH_NEW, 1))
    step_into(engine, tokens)
    assert "peer" not in engine.trace[-1].request_ids
    run_to_end(engine, tokens)
    assert engine.stats()["num_preemptions"] == 0 and engine.stats()["num_priority_preemptions"] == 0
    assert [len(tokens[r]) for r in ("lo0", "lo1", "peer")] == [LOW_NEW, LOW_NEW, HIGH_NEW]
    assert_no_leak(engine)


def test_prefill_role_sequences_held_for_sending_are_never_preempted(tiny_qwen3: str) -> None:
    """A prefill worker's prompts are the KV connector's from their arrival (exported chunk by chunk,
    then pinned): a higher class waits for room instead."""
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, role="prefill", num_kv_blocks=16,
                                    **{**KW, "max_num_batched_tokens": 32}))
    long = random_prompts(2, 56, 56, seed=33)    # 7 blocks each
    engine.add_request("lo0", long[0], greedy(4, 1))
    engine.add_request("lo1", long[1], greedy(4, 1))
    engine.step()
    engine.step()                                # lo0 pinned, lo1 mid-prefill: 2 blocks free
    assert engine.stats()["num_pinned"] == 1 and engine.scheduler.running[0].request_id == "lo1"
    engine.add_request("hi", PROMPTS[2], greedy(4, 0))
    engine.step()
    assert engine.trace[-1].request_ids == ["lo1"] and engine.trace[-1].preempted == []   # hi waits
    while engine.has_unfinished_requests() or engine.stats()["num_pinned"]:
        engine.step()
        for rid in ("lo0", "lo1", "hi"):
            engine.release(rid)          # delivered (False while not pinned)
    assert engine.stats()["num_preemptions"] == 0 and "hi" in engine.trace[-1].request_ids
    assert_no_leak(engine)


def receive(engine: LLMEngine, rid: str, index: int, token: bytes) -> HandoffState:
    """A well-formed block for a reservation (random bytes with the right layout, hash and CRC)."""
    pool = engine.kv.pool
    raw = torch.randn(pool.block_shape, generator=torch.Generator().manual_seed(index)).to(pool.dtype).numpy().tobytes()
    meta = BlockMeta(rid, index, engine.kv.receiving[rid].hashes[index], pool.dtype_name, tuple(pool.block_shape),
                     len(raw), zlib.crc32(raw))
    return engine.kv.accept(meta, token, raw)


def test_decode_role_preempts_an_admitted_sequence_never_a_reservation(tiny_qwen3: str) -> None:
    """On a decode worker a sequence admitted with received KV is recomputed like any other; a
    reservation (blocks arriving) is not the scheduler's and keeps its blocks."""
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", num_kv_blocks=12, **KW))
    rx = engine.reserve("rx", PROMPTS[0][:20], greedy(4, 2))           # 3 blocks, nothing sent yet
    lo_prompt = random_prompts(1, 40, 40, seed=34)[0]
    lo = engine.reserve("lo", lo_prompt, greedy(20, 1))                # 5 blocks
    for i in lo.needed_block_indices:
        receive(engine, "lo", i, lo.transfer_token)
    assert engine.admit("lo", 5) is None and lo.num_blocks == 5
    engine.step()                                                      # lo decodes: 6 blocks, 3 free
    tokens: dict[str, list[int]] = {}
    engine.add_request("hi", PROMPTS[2], greedy(4, 0))
    step_into(engine, tokens)
    assert engine.trace[-1].preempted == ["lo"] and "hi" in engine.trace[-1].request_ids
    assert engine.kv.state("rx") is HandoffState.RESERVED and engine.stats()["num_reserved"] == 1
    run_to_end(engine, tokens)
    assert len(tokens["hi"]) == 4 and rx.num_blocks == 3
    assert engine.abort("rx")
    assert_no_leak(engine)


def test_a_higher_class_reservation_on_a_full_decode_pool_preempts_a_lower_class(tiny_qwen3: str) -> None:
    """A decode worker full of a lower class (a local prompt here, whose KV is real): the
    higher-class reservation is refused once, with a claim; the next step preempts the lower
    sequence (recomputed later from its prompt and tokens, exact), and the reservation asked
    again fits. A reservation of the same class or a lower one leaves no claim."""
    from pdserve.engine.llm_engine import NoCapacity
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", num_kv_blocks=10, **KW))
    lo_prompt = random_prompts(1, 40, 40, seed=35)[0]
    engine.add_request("lo", lo_prompt, greedy(24, 1))                # prefilled here: its KV is real
    tokens: dict[str, list[int]] = {}
    while engine.stats()["num_free_blocks"] > 4:                      # 5 blocks, then 6 as it decodes
        step_into(engine, tokens)
    hi_prompt = random_prompts(1, 40, 40, seed=36)[0]
    for priority in (1, 2):                                            # not above lo's class: no claim
        with pytest.raises(NoCapacity, match="keeping"):
            engine.reserve("peer", hi_prompt, greedy(4, priority))
    assert engine.scheduler.claim is None
    with pytest.raises(NoCapacity, match="being preempted"):
        engine.reserve("hi", hi_prompt, greedy(4, 0))
    step_into(engine, tokens)   # lo is preempted, and waits (the claim keeps its room free): no step runs
    assert [q.request_id for q in engine.scheduler.waiting] == ["lo"] and not engine.scheduler.running
    hi = engine.reserve("hi", hi_prompt, greedy(4, 0))
    assert engine.scheduler.claim is None                              # taken
    for i in hi.needed_block_indices:
        receive(engine, "hi", i, hi.transfer_token)
    assert engine.admit("hi", 7) is None
    tokens["hi"] = [7]
    run_to_end(engine, tokens)
    assert len(tokens["hi"]) == 4
    assert tokens["lo"] == alone(tiny_qwen3, lo_prompt, 24)            # recomputed: as if never preempted
    assert engine.stats()["num_priority_preemptions"] == 1
    assert_no_leak(engine)
