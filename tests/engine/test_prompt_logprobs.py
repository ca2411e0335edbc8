"""Prompt log-probabilities (SamplingParams.prompt_logprobs, what ``echo`` + ``logprobs`` and
vLLM's ``prompt_logprobs`` report): each prompt token's logprob given the tokens before it, its
rank and the most likely alternatives, equal to HF transformers' in float32. Chunked prefill,
a prefix cache holding the prompt, neighbours in the batch and preemption mid-prompt change
nothing; a neighbour that does not ask keeps its cache hits."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams, model_runner
from tests.conftest import assert_no_leak, random_prompts

PROMPTS = random_prompts(4, 9, 70, seed=45)
TOP = 3


def _hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: HF's float32 log-probabilities after each prompt position but the last."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def references(tiny_model: str) -> list[torch.Tensor]:
    return [_hf_prompt_logprobs(tiny_model, p) for p in PROMPTS]


def _check(prompt: list[int], scores: list, reference: torch.Tensor) -> None:
    assert len(scores) == len(prompt) and scores[0] is None
    for k, lp in enumerate(scores[1:], start=1):
        row = reference[k - 1]
        assert lp.logprob == pytest.approx(row[prompt[k]].item(), abs=2e-4), k
        assert lp.rank == int((row > row[prompt[k]]).sum()) + 1, k
        values, ids = row.topk(TOP)
        assert lp.top_logprobs == pytest.approx(values.tolist(), abs=2e-4), k
        assert lp.top_ids == ids.tolist() or sorted(values.tolist()) != values.tolist(), k


@pytest.mark.parametrize("budget,logit_rows", [(2048, 512), (16, 512), (2048, 3)], ids=["whole", "chunked", "sliced"])
def test_prompt_logprobs_equal_hf_float32(tiny_model: str, references: list[torch.Tensor], budget: int,
                                          logit_rows: int, monkeypatch) -> None:
    """sliced: logits computed 3 rows at a time: slices across the sampled rows (4 decodes), the prompts' segments and between them."""
    monkeypatch.setattr(model_runner, "LOGIT_ROWS", logit_rows)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    with LLM(tiny_model, dtype="float32", max_num_batched_tokens=budget, max_num_seqs=4) as llm:
        outs = llm.generate(PROMPTS, params)
        for prompt, out, ref in zip(PROMPTS, outs, references):
            _check(prompt, out.prompt_logprobs, ref)
            assert out.logprobs is None and len(out.token_ids) == 2
        assert_no_leak(llm)


def test_a_cached_prompt_is_scored_in_full_and_a_neighbour_keeps_its_hits(tiny_model: str,
                                                                          references: list[torch.Tensor]) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    with LLM(tiny_model, dtype="float32", block_size=4) as llm:
        first = llm.generate(PROMPTS[:2], plain)
        again = llm.generate(PROMPTS[:2], [scored, plain])   # both prompts are in the prefix cache now
        _check(PROMPTS[0], again[0].prompt_logprobs, references[0])
        assert again[0].num_cached_tokens == 0 and again[1].num_cached_tokens > 0
        assert again[1].prompt_logprobs is None
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        assert_no_leak(llm)


def test_a_prompt_preempted_mid_prefill_is_scored_once(tiny_model: str, references: list[torch.Tensor]) -> None:
    """A scored prompt of a low class, preempted after its first chunks by a higher class that
    needs the pool: it is recomputed from its first unscored position, and each prompt token
    gets exactly one score, the same as alone."""
    engine = LLMEngine(EngineConfig(model=tiny_model, dtype="float32", block_size=4, num_kv_blocks=24,
                                    max_num_batched_tokens=8, enable_prefix_caching=False))
    low = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    engine.add_request("low", PROMPTS[low], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                           prompt_logprobs=0, priority=1))
    engine.step()
    engine.step()
    engine.add_request("high", list(range(1, 80)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    scores = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "low" and out.prompt_logprobs is not None:
                assert scores is None, "reported twice"
                scores = out.prompt_logprobs
    assert engine.stats()["num_priority_preemptions"] == 1, engine.stats()
    prompt, ref = PROMPTS[low], references[low]
    assert len(scores) == len(prompt) and scores[0] is None
    for k, lp in enumerate(scores[1:], start=1):
        assert lp.logprob == pytest.approx(ref[k - 1][prompt[k]].item(), abs=2e-4) and lp.top_ids == []
    assert_no_leak(engine)
    engine.close()


def test_prompt_logprobs_out_of_range_is_refused_naming_the_field() -> None:
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
            SamplingParams(prompt_logprobs=bad).validate()


def test_prompt_logprobs_under_tensor_parallelism_sliced(tiny_qwen3: str) -> None:
    """Two ranks gather the logits of the same slices (the slicing follows the row count alone):
    two long prompts make one step of more than 2 x LOGIT_ROWS scored rows."""
    prompts = random_prompts(2, model_runner.LOGIT_ROWS + 100, model_runner.LOGIT_ROWS + 200, seed=46) + PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    with LLM(tiny_qwen3, dtype="float32") as llm:
        alone = llm.generate(prompts, params)
    threads = torch.get_num_threads()   # a TP driver runs on one torch thread (process-wide)
    try:
        with LLM(tiny_qwen3, dtype="float32", tensor_parallel_size=2) as llm:
            split = llm.generate(prompts, params)
            assert_no_leak(llm)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(alone, split):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.prompt_logprobs[1:]] == pytest.approx([lp.logprob for lp in b.prompt_logprobs[1:]],
                                                                             abs=1e-4)
        assert [lp.top_ids for lp in a.prompt_logprobs[1:]] == [lp.top_ids for lp in b.prompt_logprobs[1:]]
