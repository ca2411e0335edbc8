"""GPU code paths. The import test runs everywhere; the rest need a CUDA device."""
from __future__ import annotations

import importlib

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = random_prompts(6, 5, 50, seed=81)


def test_gpu_modules_import_cleanly_without_cuda() -> None:
    for name in ("pdserve.engine.cuda_graphs", "pdserve.engine.layers.attention", "pdserve.engine.model_runner"):
        importlib.import_module(name)
    from pdserve.engine.layers import attention
    assert isinstance(attention.HAS_FLASH_ATTN, bool)


@requires_cuda
def test_cuda_graph_decode_matches_hf(tiny_qwen3: str) -> None:
    llm = LLM(tiny_qwen3, dtype="float32", device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=8)
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(tiny_qwen3, PROMPTS, 16)


@requires_cuda
def test_cuda_eager_matches_graphs(tiny_qwen3: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=8)
    eager = LLM(tiny_qwen3, enforce_eager=True, **kw).generate(PROMPTS, params)
    graphs = LLM(tiny_qwen3, **kw).generate(PROMPTS, params)
    assert [o.token_ids for o in eager] == [o.token_ids for o in graphs]
