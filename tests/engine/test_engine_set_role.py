"""LLMEngine.set_role: an idle engine switches prefill <-> decode in place, its model and KV pool
(prefix cache included) kept: the KV connector takes the new side, the step policy follows the
role unless it was set explicitly; a busy engine refuses, naming what is still there."""
from __future__ import annotations

import zlib

import pytest

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.engine.kv.handoff import BlockMeta, HandoffState
from tests.conftest import assert_no_leak

KW = dict(dtype="float32", block_size=8, num_kv_blocks=32, max_num_batched_tokens=64, max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [(11 * i) % 200 + 3 for i in range(20)]      # 3 blocks, the last one partial


def _prefill(engine: LLMEngine, rid: str) -> tuple[int, list[int]]:
    """Run a prompt to its first token on a prefill-role engine: (first token, blocks exported)."""
    engine.add_request(rid, PROMPT, GREEDY)
    first, exported = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            exported += out.ready_blocks
            if out.prefill_done:
                first = out.new_token_ids[0]
    return first, exported


def test_a_prefill_engine_switched_to_decode_receives_admits_and_decodes_then_prefills_again(tiny_qwen3: str) -> None:
    expected = LLM(tiny_qwen3, **KW).generate([PROMPT], GREEDY)[0].token_ids
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, role="prefill", **KW))
    first, exported = _prefill(engine, "p")
    assert first == expected[0] and sorted(exported) == [0, 1, 2]
    tail = engine.kv.read_blocks("p", [2])[0].numpy().tobytes()   # the partial block: not prefix-cached
    assert engine.release("p")

    engine.set_role("decode")
    assert engine.config.role == "decode" and engine.config.policy == "mixed"
    assert not engine.kv.exports and engine.kv.paces_local_prompts
    res = engine.reserve("d", PROMPT, GREEDY)   # the full blocks it prefilled stayed cached
    assert res.needed_block_indices == [2] and len(res.held_block_hashes) == 2
    meta = BlockMeta("d", 2, transfer_block_hashes(PROMPT, 8)[2], "float32", tuple(engine.kv.pool.block_shape),
                     len(tail), zlib.crc32(tail))
    assert engine.kv.accept(meta, res.transfer_token, tail) is HandoffState.READY
    assert engine.admit("d", first) is None
    tokens = [first]
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not out.prefill_done and not out.ready_blocks   # decode role: nothing exported
            tokens += out.new_token_ids
    assert tokens == expected
    assert_no_leak(engine)

    engine.set_role("prefill")
    assert engine.config.policy == "prefill_first" and engine.kv.exports and not engine.kv.paces_local_prompts
    assert engine.scheduler.prompt_tokens_with_decodes is None   # a decode worker's learned chunk is dropped
    again, exported = _prefill(engine, "p2")
    assert again == first and engine.stats()["num_pinned"] == 1 and exported
    assert engine.release("p2")
    assert_no_leak(engine)


def test_a_busy_engine_refuses_naming_what_is_there(tiny_qwen3: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, role="prefill", **KW))
    engine.add_request("queued", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="'prefill' -> 'decode'.*1 waiting"):
        engine.set_role("decode")
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="1 pinned for sending"):   # computed, its KV not yet delivered
        engine.set_role("decode")
    assert engine.config.role == "prefill" and engine.kv.exports   # nothing changed
    assert engine.release("queued")
    engine.set_role("decode")
    engine.reserve("r", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="1 reserved/receiving KV"):
        engine.set_role("prefill")
    assert engine.abort("r")
    engine.set_role("prefill")
    with pytest.raises(ValueError, match="role must be one of"):
        engine.set_role("router")
    assert engine.busy_reasons() == []
    assert_no_leak(engine)


def test_the_connector_never_switches_under_a_live_handle(tiny_qwen3: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", **KW))
    engine.reserve("r", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="1 reception"):
        engine.kv.set_role("prefill")
    assert engine.kv.paces_local_prompts and not engine.kv.exports
    engine.abort("r")


@pytest.mark.parametrize("policy, expected", [("auto", {"prefill": "prefill_first", "decode": "mixed"}),
                                              ("interleave", {"prefill": "interleave", "decode": "interleave"})])
def test_the_step_policy_follows_the_role_unless_set(tiny_qwen3: str, policy: str, expected: dict) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", schedule_policy=policy, **KW))
    for role in ("decode", "prefill", "decode", "prefill"):
        engine.set_role(role)
        assert engine.config.schedule_policy == policy and engine.config.policy == expected[role]
        assert engine.scheduler.config.policy == expected[role]   # what schedule() reads


@pytest.mark.parametrize("budget, expected", [(None, {"prefill": 512, "decode": 2048, "both": 2048}),
                                              (96, {"prefill": 96, "decode": 96, "both": 96})])
def test_the_step_budget_follows_the_role_unless_set(tiny_qwen3: str, budget, expected: dict) -> None:
    """Left to the engine, a CPU prefill worker's steps hold 512 tokens and other roles' 2048; a
    budget that is set stays, whatever the role. A prompt longer than the budget runs in steps of
    it, as the scheduler reads it."""
    kw = {**KW, "max_num_batched_tokens": budget, "max_model_len": 2048, "num_kv_blocks": 160}
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, role="both", **kw))
    assert engine.config.max_num_batched_tokens == expected["both"]
    for role in ("prefill", "decode", "prefill"):
        engine.set_role(role)
        assert engine.config.max_num_batched_tokens == expected[role] == engine.prompt_chunk_tokens()
    engine.add_request("long", [(7 * i) % 200 + 3 for i in range(1000)], GREEDY)
    engine.step()
    assert engine.trace[-1].num_prefill_tokens == expected["prefill"]
    engine.abort("long")
    assert_no_leak(engine)
