"""The step trace shows each policy's shape while a long prompt is chunked and decoders run."""
from __future__ import annotations

from pdserve.engine import LLM, SamplingParams
from tests.conftest import assert_no_leak, random_prompts

LONG = random_prompts(1, 120, 120, seed=11)[0]
SHORTS = random_prompts(4, 4, 8, seed=12)
DECODE = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def run_scenario(model: str, policy: str) -> list[str]:
    """Four short requests start decoding, then a 120-token prompt arrives under a 16-token budget.
    Returns the step kinds from the long prompt's arrival until its prefill is done."""
    llm = LLM(model, dtype="float32", block_size=8, num_kv_blocks=128, max_num_batched_tokens=16,
              max_num_seqs=8, schedule_policy=policy)
    engine = llm.engine
    for i, p in enumerate(SHORTS):
        engine.add_request(f"short{i}", p, DECODE)
    while any(s.is_prefilling or not s.num_output_tokens for s in engine.requests.values()):
        engine.step()
    engine.step()   # a pure decode step, so every policy starts from the same state
    assert engine.trace[-1].kind.value == "decode"
    start = len(engine.trace)
    engine.add_request("long", LONG, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.requests["long"].is_prefilling or engine.requests["long"].num_output_tokens == 0:
        engine.step()
    kinds = [t.kind.value for t in list(engine.trace)[start:]]
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(llm)
    return kinds


def test_interleave_alternates_prefill_and_decode(tiny_qwen3: str) -> None:
    kinds = run_scenario(tiny_qwen3, "interleave")
    # 120 tokens in 8 chunks of 16; after each chunk but the last, the decoders get a step
    assert kinds == ["prefill", "decode"] * 7 + ["prefill"]


def test_prefill_first_runs_chunks_back_to_back(tiny_qwen3: str) -> None:
    kinds = run_scenario(tiny_qwen3, "prefill_first")
    assert kinds == ["prefill"] * 8


def test_mixed_carries_decodes_with_chunks(tiny_qwen3: str) -> None:
    kinds = run_scenario(tiny_qwen3, "mixed")
    # 4 decode tokens + 12 prompt tokens per step: 120 / 12 = 10 mixed steps
    assert kinds == ["mixed"] * 10
