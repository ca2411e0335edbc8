"""Engine API: validation, seeded sampling, abort, prefill→decode handoff, W8A16, pool sizing."""
from __future__ import annotations

import math
import threading
import time
import zlib

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, LLMEngine, NoCapacity, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.engine.kv.handoff import BlockMeta, HandoffError, HandoffState, LeasePolicy
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


def _ship(prefill: LLMEngine, decode: LLMEngine, rid: str, reservation, indices: list[int]) -> None:
    """What a transport does: copy blocks out, send bytes with a header, the connector checks and stores them."""
    data = prefill.kv.read_blocks(rid, indices)
    hashes = transfer_block_hashes(prefill.kv.sending[rid].seq.token_ids[:-1], 8)
    for j, idx in enumerate(indices):
        raw = data[j].numpy().tobytes()                  # what goes on the wire
        meta = BlockMeta(rid, idx, hashes[idx], "float32", tuple(data.shape[1:]), len(raw), zlib.crc32(raw))
        decode.kv.accept(meta, reservation.transfer_token, raw)


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
        res = decode.reserve(rid, p, GREEDY)
        assert sorted(ready[rid]) == list(range(-(-len(p) // 8))) == res.needed_block_indices
        assert decode.kv.state(rid) is HandoffState.RESERVED
        with pytest.raises(HandoffError, match="still misses"):
            decode.admit(rid, firsts[rid])
        _ship(prefill, decode, rid, res, res.needed_block_indices)
        assert decode.kv.state(rid) is HandoffState.READY
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
    res = decode.reserve("again", prompts[0], GREEDY)
    assert res.needed_block_indices == list(range(len(prompts[0]) // 8, -(-len(prompts[0]) // 8)))
    decode.abort("again")
    assert_no_leak(decode)


def test_handoff_fails_closed_on_any_bad_block(tiny_qwen3: str) -> None:
    """Wrong token, hash, layout or checksum: the whole reservation is freed at once, with its reason kept."""
    decode = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", **KW))
    prompt = PROMPTS[0][:20]
    hashes = transfer_block_hashes(prompt, 8)
    shape = decode.runner.block_shape
    good = torch.zeros(shape).numpy().tobytes()
    cases = {
        "token": lambda m, t: (m, b"x" * 16, good),
        "hash": lambda m, t: (BlockMeta(m.request_id, 0, m.block_hash ^ 1, m.dtype, m.shape, m.nbytes, m.checksum), t, good),
        "layout": lambda m, t: (BlockMeta(m.request_id, 0, m.block_hash, "bfloat16", m.shape, m.nbytes // 2, m.checksum), t, good),
        "checksum": lambda m, t: (BlockMeta(m.request_id, 0, m.block_hash, m.dtype, m.shape, m.nbytes, m.checksum ^ 1), t, good),
        "index": lambda m, t: (BlockMeta(m.request_id, 9, m.block_hash, m.dtype, m.shape, m.nbytes, m.checksum), t, good),
    }
    codes = {"token": "UNAUTHENTICATED", "hash": "DATA_LOSS", "layout": "DATA_LOSS", "checksum": "DATA_LOSS",
             "index": "DATA_LOSS"}
    for name, corrupt in cases.items():
        rid = f"bad-{name}"
        res = decode.reserve(rid, prompt, GREEDY)
        meta = BlockMeta(rid, 0, hashes[0], "float32", tuple(shape), len(good), zlib.crc32(good))
        with pytest.raises(HandoffError) as err:
            decode.kv.accept(*corrupt(meta, res.transfer_token))
        assert err.value.code == codes[name], name
        if name == "token":   # a stranger cannot fail someone else's request
            assert decode.kv.state(rid) is HandoffState.RESERVED
            decode.abort(rid)
        else:
            assert decode.kv.state(rid) is HandoffState.FAILED
            with pytest.raises(HandoffError) as again:
                decode.admit(rid, 5)
            assert again.value.code == codes[name]
        assert_no_leak(decode)


def test_reservation_lease_lapses_without_progress_and_progress_extends_it(tiny_qwen3: str) -> None:
    decode = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", **{**KW, "num_kv_blocks": 10}),
                       lease=LeasePolicy(idle_s=0.2, max_s=0.6))
    res = decode.reserve("a", [5] * 40, GREEDY)
    assert len(res.needed_block_indices) == 5
    with pytest.raises(NoCapacity):
        decode.reserve("b", [7] * 40, GREEDY)   # 5 more blocks + 1 kept as headroom, 5 free
    t0 = time.monotonic()
    assert decode.kv.expire(t0 + 0.1) == []
    time.sleep(0.1)   # kept: the lease clock must move for progress to extend it (what is tested)
    t1 = time.monotonic()
    decode.kv.heartbeat("a", res.transfer_token)  # progress: lapses 0.2 s after t1 instead of after t0
    assert decode.kv.expire(t1 + 0.15) == []      # t1 + 0.15 > t0 + 0.2: the lease was extended
    assert decode.kv.expire(t0 + 0.7) == ["a"]    # the cap (0.6 s) holds whatever the progress
    with pytest.raises(HandoffError) as err:
        decode.admit("a", 5)
    assert err.value.code == "DEADLINE_EXCEEDED" and "lease cap" in str(err.value)
    assert len(decode.reserve("b", [7] * 40, GREEDY).needed_block_indices) == 5
    decode.abort("b")
    assert_no_leak(decode)


def test_abort_during_a_step_frees_blocks_after_it(tiny_qwen3: str) -> None:
    """abort() from another thread never waits for the forward pass; the blocks go when it ends."""
    engine = LLMEngine(EngineConfig(model=tiny_qwen3, **KW))
    engine.add_request("r", PROMPTS[1], GREEDY)
    engine.step()
    started, release = threading.Event(), threading.Event()
    run = engine.runner.run

    def slow_run(batch, *args):
        started.set()
        release.wait(10)
        return run(batch, *args)

    engine.runner.run = slow_run
    worker = threading.Thread(target=engine.step)
    worker.start()
    assert started.wait(10)
    held = engine.stats()["num_free_blocks"]
    assert engine.abort("r")                       # returns while the step still runs
    engine.add_request("s", PROMPTS[2], GREEDY)     # and new work is accepted at once
    assert engine.stats()["num_free_blocks"] == held
    release.set()
    worker.join(10)
    engine.runner.run = run
    engine.abort("s")
    assert_no_leak(engine)


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
