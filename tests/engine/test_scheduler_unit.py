"""Scheduler (engine/scheduler.py), pure Python: a real block manager, no model, no forward pass."""
from __future__ import annotations

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, StepKind
from pdserve.engine.sequence import Sequence, SequenceStatus

PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


def make(policy: str = "mixed", blocks: int = 64, budget: int = 8, max_seqs: int = 8,
         with_decodes: int | None = None, order: str = "fcfs") -> Scheduler:
    config = EngineConfig(model="none", block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          schedule_policy=policy, prompt_tokens_with_decodes=with_decodes, prompt_order=order)
    return Scheduler(config, BlockManager(blocks, 4))


def seq(rid: str, n: int, base: int = 0) -> Sequence:
    return Sequence(rid, [base + i for i in range(n)], PARAMS)


def run(s: Scheduler) -> list[tuple[str, int]]:
    """One step as the engine applies it: tokens computed, a token sampled at each prompt's end."""
    batch = s.schedule()
    assert batch is not None
    for q, n in zip(batch.seqs, batch.num_new_tokens):
        q.num_computed_tokens += n
        s.block_manager.mark_computed(q)
        if q.num_computed_tokens == q.num_tokens:   # the chunk reached the end: a token is sampled
            q.token_ids.append(1)
            q.first_token_time = q.first_token_time or 1.0
    return [(q.request_id, n) for q, n in zip(batch.seqs, batch.num_new_tokens)]


def test_chunked_prefill_under_the_budget() -> None:
    s = make(budget=8)
    s.add(seq("a", 20))
    assert [run(s) for _ in range(3)] == [[("a", 8)], [("a", 8)], [("a", 4)]]
    assert s.running[0].num_computed_tokens == 20 and s.running[0].num_output_tokens == 1


def test_continuous_batching_admits_new_work_into_a_running_batch() -> None:
    s = make(budget=16)
    s.add(seq("a", 4))
    assert run(s) == [("a", 4)]
    s.add(seq("b", 6, base=100))
    assert run(s) == [("a", 1), ("b", 6)]          # mixed: a's decode and b's prompt in one step
    assert s.last_kind is StepKind.MIXED
    assert run(s) == [("a", 1), ("b", 1)]
    assert s.last_kind is StepKind.DECODE


def test_prefill_first_never_starves_a_prompt_whose_last_chunk_is_one_token() -> None:
    """Budget 8, a 9-token prompt ahead of a steady stream of prompts: its second chunk is its one
    last token (a decoder by the pending count alone), computed in the next step, not after the
    stream dries up."""
    s = make("prefill_first", blocks=256, budget=8)
    s.add(seq("a", 9))
    for i in range(1, 4):
        s.add(seq(f"b{i}", 16, base=100 * i))
    steps = [run(s) for _ in range(2)]
    assert steps == [[("a", 8)], [("a", 1), ("b1", 7)]]
    assert s.running[0].num_output_tokens == 1


def test_max_num_seqs_keeps_the_rest_waiting() -> None:
    s = make(budget=64, max_seqs=2)
    for i in range(3):
        s.add(seq(f"r{i}", 4, base=10 * i))
    assert [rid for rid, _ in run(s)] == ["r0", "r1"]
    assert [q.request_id for q in s.waiting] == ["r2"]


def policy_steps(policy: str) -> list[str]:
    """A sequence decodes; a 16-token prompt arrives under an 8-token budget: each step's contents."""
    s = make(policy, budget=8)
    s.add(seq("d", 4))
    run(s)
    s.add(seq("p", 16, base=50))
    steps = []
    while s.waiting or any(q.is_prefilling for q in s.running):
        contents = run(s)
        steps.append(s.last_kind.value + ":" + ",".join(f"{r}{n}" for r, n in contents))
    return steps


def test_each_policy_step_contents() -> None:
    assert policy_steps("mixed") == ["mixed:d1,p7", "mixed:d1,p7", "mixed:d1,p2"]
    assert policy_steps("prefill_first") == ["prefill:p8", "prefill:p8"]
    # the step before was d's prompt: decoders get a step after each prompt step
    assert policy_steps("interleave") == ["decode:d1", "prefill:p8", "decode:d1", "prefill:p8"]


def test_prompt_tokens_with_decodes_caps_a_mixed_step() -> None:
    s = make(budget=16, with_decodes=4)
    s.add(seq("d", 4))
    run(s)
    s.add(seq("p", 16, base=50))
    assert run(s) == [("d", 1), ("p", 4)]


def test_recompute_preemption_frees_the_youngest_and_requeues_it_first() -> None:
    s = make(budget=64, blocks=5)
    s.add(seq("old", 8))
    s.add(seq("young", 8, base=100))
    run(s)                                           # both prompts fill 2 blocks each, 1 left
    assert s.block_manager.num_free_blocks == 1
    batch = s.schedule()                             # old's 9th token takes the last block: young goes
    assert [q.request_id for q in batch.seqs] == ["old"]
    young = s.waiting[0]
    assert young.request_id == "young" and young.status is SequenceStatus.WAITING
    assert young.num_computed_tokens == 0 and young.block_table == []
    assert s.num_preemptions == 1
    assert s.trace(1, batch).preempted == ["young"]


def test_watermark_holds_admission_back_while_others_run() -> None:
    s = make(budget=1024, blocks=200)                # watermark: 200 // 100 = 2 blocks
    assert s.watermark_blocks == 2
    s.add(seq("a", 4 * 190 - 1))
    run(s)
    assert s.block_manager.num_free_blocks == 10
    s.add(seq("b", 4 * 9, base=9999))                # would leave 1 < 2 free: not admitted
    assert [rid for rid, _ in run(s)] == ["a"]
    assert [q.request_id for q in s.waiting] == ["b"]
    a = s.running[0]
    s.remove(a)
    s.block_manager.free(a)                          # nothing runs: the watermark does not apply
    assert [rid for rid, _ in run(s)] == ["b"]


def arrived(rid: str, n: int, at: float, priority: int = 0) -> Sequence:
    q = Sequence(rid, list(range(n)), SamplingParams(temperature=0.0, max_tokens=8, priority=priority))
    q.arrival_time = at
    return q


def test_fcfs_admits_in_arrival_order_within_a_class() -> None:
    s = make(budget=1024, order="fcfs")
    for q in (arrived("long", 40, 0.0), arrived("short", 4, 0.0), arrived("mid", 12, 0.0)):
        s.add(q)
    assert [q.request_id for q in s.waiting] == ["long", "short", "mid"]


def test_shortest_admits_a_bursts_short_prompts_first() -> None:
    s = make(budget=16, order="shortest")
    s.prompt_s_per_token = 0.01
    for q in (arrived("long", 40, 0.0), arrived("short", 4, 0.0), arrived("mid", 12, 0.0)):
        s.add(q)
    assert [q.request_id for q in s.waiting] == ["short", "mid", "long"]
    assert run(s) == [("short", 4), ("mid", 12)]     # both finish in the first step; long waits


def test_shortest_passes_a_prompt_only_by_those_that_arrived_before_it_would_finish_alone() -> None:
    s = make(budget=1024, order="shortest")
    s.prompt_s_per_token = 0.01                      # long alone: 40 tokens, 0.4 s
    s.add(arrived("long", 40, 0.0))
    s.add(arrived("early-short", 4, 0.3))            # 0.34 < 0.4: ahead of long
    s.add(arrived("late-short", 4, 0.5))             # 0.54 > 0.4: after long, however short
    assert [q.request_id for q in s.waiting] == ["early-short", "long", "late-short"]


def test_shortest_lets_a_burst_pass_a_long_prompt_already_under_way() -> None:
    """A long prompt starts alone; a short one arrives while it is mid-prefill. shortest: the short
    one takes the next step's budget first and the long one what is left (the key of a started
    prompt counts the tokens it has left); fcfs: the long one's chunk first. A short prompt that
    arrives after the long one would have finished alone does not pass it."""
    def at(q: Sequence, t: float) -> Sequence:
        q.arrival_time = t
        return q
    for order, want in (("shortest", [("short", 4), ("long", 12)]), ("fcfs", [("long", 16)])):
        s = make(budget=16, order=order)
        s.prompt_s_per_token = 0.01
        s.add(at(seq("long", 64), 0.0))
        assert run(s) == [("long", 16)]               # 48 tokens left: alone it ends at 0.48
        s.add(at(seq("short", 4, base=1000), 0.1))     # 0.14 < 0.48
        assert run(s) == want, order
    s = make(budget=16, order="shortest")
    s.prompt_s_per_token = 0.01
    s.add(at(seq("long", 64), 0.0))
    run(s)
    s.add(at(seq("late", 4, base=1000), 0.5))          # 0.54 > 0.48: after the long one's chunks
    assert run(s) == [("long", 16)]
    assert [run(s) for _ in range(2)] == [[("long", 16)], [("long", 16)]]
    assert run(s) == [("long", 1), ("late", 4)]       # the long one decodes; the late one is admitted


def test_shortest_keeps_classes_and_a_preempted_prompt_ahead_of_its_class() -> None:
    s = make(budget=1024, order="shortest")
    s.add(arrived("low-short", 2, 0.0, priority=1))
    s.add(arrived("high-long", 40, 0.0, priority=0))
    assert [q.request_id for q in s.waiting] == ["high-long", "low-short"]
    s = make(budget=64, order="shortest")
    s.add(arrived("old", 8, 0.0))
    s.add(arrived("young", 8, 0.0))
    run(s)
    s.add(arrived("tiny", 1, -1.0))                  # shorter than young and here before it: its key is lower
    young = s.running[1]
    s._preempt(young)                                # what growth or a higher class does to the youngest
    assert [q.request_id for q in s.waiting] == ["young", "tiny"]
