"""Greedy output of the engine equals Hugging Face transformers, under every scheduling path."""
from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.conftest import assert_no_leak, hf_greedy, random_prompts

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = random_prompts(8, 3, 70, seed=1)


def make_llm(model: str, **overrides) -> LLM:
    kwargs = dict(dtype="float32", block_size=8, num_kv_blocks=256, max_num_batched_tokens=256, max_num_seqs=16)
    kwargs.update(overrides)
    return LLM(model, **kwargs)


def test_batch_matches_hf(tiny_model: str) -> None:
    llm = make_llm(tiny_model)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_model, PROMPTS, MAX_NEW)
    assert all(o.finish_reason == "length" for o in outs)
    assert_no_leak(llm)


@pytest.mark.parametrize("budget", [3, 7, 16, 50])
def test_chunked_prefill_matches_unchunked(tiny_model: str, budget: int) -> None:
    llm = make_llm(tiny_model, max_num_batched_tokens=budget, max_num_seqs=min(budget, 16), schedule_policy="prefill_first")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_model, PROMPTS, MAX_NEW)
    prefill_steps: dict[str, int] = {}
    for t in llm.engine.trace:
        if t.kind.value == "prefill":
            assert t.num_prefill_tokens <= budget
            for rid in t.request_ids:
                prefill_steps[rid] = prefill_steps.get(rid, 0) + 1
    assert max(prefill_steps.values()) >= 2, "some prompt must have been split across steps"
    assert_no_leak(llm)


def test_prefix_cache_hits_keep_output(tiny_model: str) -> None:
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    tails = random_prompts(4, 2, 9, seed=8)
    prompts = [prefix + t for t in tails]
    llm = make_llm(tiny_model)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 3 * 40 // 8 * 8, stats
    assert [o.token_ids for o in first + rest] == hf_greedy(tiny_model, prompts, MAX_NEW)
    assert all(o.num_cached_tokens == 40 for o in rest)
    assert_no_leak(llm)


def test_identical_prompts_in_one_step_share_blocks(tiny_qwen3: str) -> None:
    prompt = random_prompts(1, 33, 33, seed=3)[0]   # 4 full blocks of 8 + 1 token
    llm = make_llm(tiny_qwen3, max_num_batched_tokens=256)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"r{i}", prompt, GREEDY)
    outs: dict[str, list[int]] = {}
    for o in engine.step():   # all three admitted and prefilled in the same step
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert len(outs) == 3
    tables = [engine.requests[f"r{i}"].block_table for i in range(3)]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4], tables
    assert len({t[4] for t in tables}) == 3, "the partial last block is private"
    assert engine.stats()["num_total_blocks"] - engine.stats()["num_free_blocks"] == 4 + 3
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    ref = hf_greedy(tiny_qwen3, [prompt], MAX_NEW)[0]
    assert all(outs[f"r{i}"] == ref for i in range(3))
    assert_no_leak(llm)


def test_preemption_keeps_output(tiny_model: str) -> None:
    # 8 prompts of up to 70 + 20 tokens in blocks of 8 need far more than 24 blocks at once.
    llm = make_llm(tiny_model, num_kv_blocks=24)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == hf_greedy(tiny_model, PROMPTS, MAX_NEW)
    assert_no_leak(llm)


@pytest.mark.parametrize("policy", ["prefill_first", "interleave", "mixed"])
def test_policies_give_identical_output(tiny_model: str, policy: str) -> None:
    llm = make_llm(tiny_model, schedule_policy=policy, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_model, PROMPTS, MAX_NEW)
    if policy == "mixed":
        assert any(t.kind.value == "mixed" for t in llm.engine.trace)
    assert_no_leak(llm)


def test_stop_tokens_and_eos(tiny_qwen3: str) -> None:
    llm = make_llm(tiny_qwen3)
    ref = hf_greedy(tiny_qwen3, PROMPTS[:1], MAX_NEW)[0]
    stop_at = ref[5]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:ref.index(stop_at) + 1]
    assert_no_leak(llm)
