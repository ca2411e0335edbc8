"""GPU code paths. The fallback test runs where there is no CUDA device; the rest need one."""
from __future__ import annotations

import importlib

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = random_prompts(6, 5, 50, seed=81)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_without_cuda_the_gpu_paths_import_report_off_and_the_engine_runs_on_cpu(tiny_qwen3: str,
                                                                                 monkeypatch) -> None:
    """The CUDA-only modules import on a CPU machine and say their kernels are absent; the engine
    picks the CPU (no CUDA graphs, a CPU backend), and even with flash-attn claimed present at a block
    size it takes, attention on CPU tensors never goes down the flash path: greedy tokens are HF's."""
    for name in ("pdserve.engine.cuda_graphs", "pdserve.engine.layers.attention", "pdserve.engine.model_runner"):
        importlib.import_module(name)
    from pdserve.engine.layers import attention, cpu_kernels
    from pdserve.engine.layers.backend import TORCH
    from pdserve.engine.model_runner import resolve_device

    assert attention.HAS_FLASH_ATTN is False   # flash-attn's kernels need CUDA
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(attention, "HAS_FLASH_ATTN", True)
    monkeypatch.setattr(attention.Attention, "_flash", lambda self, q, meta: pytest.fail("flash-attn path on CPU"))
    llm = LLM(tiny_qwen3, dtype="float32", block_size=256, num_kv_blocks=8, max_num_seqs=8)   # device "auto"
    runner = llm.engine.runner
    assert runner.device == torch.device("cpu") and runner.kv_cache.device.type == "cpu"
    assert runner.graphs is None   # CUDA graphs only on a CUDA device
    assert runner.backend.name == ("native-cpu" if cpu_kernels.available() else "torch")
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = hf_greedy(tiny_qwen3, PROMPTS, 16)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == want
    runner.set_backend(TORCH)   # attention through Attention.attend, where the flash-attn gate is
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == want


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
