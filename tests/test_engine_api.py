"""Engine API: validation, seeded sampling, abort, prefill→decode handoff, W8A16, pool sizing."""
from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, NoCapacity, SamplingParams
from tests.conftest import assert_no_leak, hf_greedy, random_prompts

PROMPTS = random_prompts(6, 5, 40, seed=21)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KW = dict(dtype="float32", block_size=8, num_kv_blocks=128, max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="module")
def llm(tiny_qwen3: str) -> LLM:
    return LLM(tiny_qwen3, **KW)


@pytest.mark.parametrize("prompt, params, field", [
    ([], GREEDY, "prompt"),
    ([5, 99999], GREEDY, "vocabulary"),
    ([5, -1], GREEDY, "vocabulary"),
    ([5] * 250, SamplingParams(max_tokens=10), "max_model_len"),
    ([5], SamplingParams(temperature=-0.5), "temperature"),
    ([5], SamplingParams(temperature=math.nan), "temperature"),
    ([5], SamplingParams(temperature=math.inf), "temperature"),
    ([5], SamplingParams(top_p=0.0), "top_p"),
    ([5], SamplingParams(top_p=1.5), "top_p"),
    ([5], SamplingParams(top_k=-1), "top_k"),
    ([5], SamplingParams(max_tokens=0), "max_tokens"),
])
def test_bad_input_raises_and_engine_stays_usable(llm: LLM, prompt, params, field) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids   # still serving
    assert_no_leak(llm)


def test_one_bad_prompt_schedules_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(max_tokens=0)])
    assert not llm.engine.has_unfinished_requests()


def test_unknown_config_field(tiny_qwen3: str) -> None:
    with pytest.raises(ValueError, match="unknown config field.*block_sise"):
        LLM(tiny_qwen3, block_sise=8)
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(model=tiny_qwen3, schedule_policy="fifo")


def test_unsupported_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path))


def test_string_prompts_and_text(llm: LLM) -> None:
    out = llm.generate(["Hello there, how are you?"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_seeded_sampling_reproduces(llm: LLM) -> None:
    params = [SamplingParams(temperature=8.0, top_p=0.95, top_k=200, max_tokens=16, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    a = [o.token_ids for o in llm.generate(PROMPTS, params)]
    b = [o.token_ids for o in llm.generate(PROMPTS[::-1], params[::-1])][::-1]   # other batch order
    c = llm.generate(PROMPTS[2:3], params[2:3])[0].token_ids                   # alone
    assert a == b
    assert a[2] == c
    greedy = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert a != greedy
    unseeded = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=8.0, max_tokens=16, ignore_eos=True))]
    assert unseeded != a


def test_top_k_one_is_greedy(llm: LLM) -> None:
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_abort_frees_blocks_everywhere(tiny_qwen3: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, **KW))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    assert engine.abort("r0") and engine.abort("r5")
    assert not engine.abort("r0")
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)


def test_prefill_to_decode_handoff_matches_colocated(tiny_qwen3: str) -> None:
    """Prefill in one engine, ship blocks as bytes, decode in another: same tokens as HF."""
    prefill = LLMEngine(EngineConfig(model=tiny_qwen3, role="prefill", **{**KW, "max_num_batched_tokens": 16}))
    decode = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", **KW))
    prompts = PROMPTS[:3]
    firsts: dict[str, int] = {}
    ready: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, GREEDY)
    chunks = 0
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            ready.setdefault(out.request_id, []).extend(out.ready_blocks)
            chunks += 1
            if out.prefill_done:
                firsts[out.request_id] = out.new_token_ids[0]
    assert chunks > len(prompts), "prompts longer than 16 tokens report blocks chunk by chunk"
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        needed = decode.reserve(rid, p, GREEDY)
        assert sorted(ready[rid]) == list(range(len(prefill.block_ids(rid))))
        data = prefill.read_kv_blocks(rid, needed)
        raw = data.numpy().tobytes()                     # what goes on the wire
        back = torch.frombuffer(bytearray(raw), dtype=data.dtype).reshape(data.shape)
        for j, idx in enumerate(needed):
            decode.write_kv_block(rid, idx, back[j])
        assert prefill.release(rid)
        decode.admit(rid, firsts[rid])
    outs: dict[str, list[int]] = {f"r{i}": [firsts[f"r{i}"]] for i in range(len(prompts))}
    while decode.has_unfinished_requests():
        for out in decode.step():
            outs[out.request_id].extend(out.new_token_ids)
    assert [outs[f"r{i}"] for i in range(len(prompts))] == hf_greedy(tiny_qwen3, prompts, 16)
    assert_no_leak(prefill)
    assert_no_leak(decode)
    # The decode pool now caches those prompts: a second reservation needs only the tail blocks.
    needed = decode.reserve("again", prompts[0], GREEDY)
    assert needed == list(range(len(prompts[0]) // 8, -(-len(prompts[0]) // 8)))
    decode.abort("again")
    assert_no_leak(decode)


def test_reservation_expires_and_capacity_is_refused(tiny_qwen3: str) -> None:
    decode = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", **{**KW, "num_kv_blocks": 8}))
    assert len(decode.reserve("a", [5] * 40, GREEDY, timeout_s=0.0)) == 5
    with pytest.raises(NoCapacity):
        decode.reserve("b", [7] * 40, GREEDY)   # 5 more blocks, 3 free
    assert decode.expire_reservations() == ["a"]
    assert len(decode.reserve("b", [7] * 40, GREEDY)) == 5
    decode.abort("b")
    assert_no_leak(decode)


def test_w8a16_quantization(tiny_qwen3: str) -> None:
    llm = LLM(tiny_qwen3, quantization="w8a16", **KW)
    linear = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert linear.qweight.dtype == torch.int8 and linear.scale.shape == (linear.out_features,)
    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    ref = hf_greedy(tiny_qwen3, PROMPTS, 16)
    first_agree = sum(o[0] == r[0] for o, r in zip(outs, ref))
    assert first_agree >= len(PROMPTS) - 1, (outs, ref)


def test_pool_sized_from_memory_budget(tiny_qwen3: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, dtype="float32", block_size=16, kv_cache_memory_bytes=1 << 20))
    per_block = 2 * 2 * 16 * 2 * 32 * 4   # K+V, layers, block, kv heads, head_dim, float32
    assert engine.stats()["num_total_blocks"] == (1 << 20) // per_block
