"""The native CPU kernels agree with the torch paths they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.layers import cpu_kernels
from tests.conftest import hf_greedy, random_prompts

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler: torch paths only")


def _reference_decode(q, k_cache, v_cache, tables, lens, scale):
    out = []
    bs = k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        keys = k_cache[tables[b]].reshape(-1, *k_cache.shape[2:])[:n].float()
        values = v_cache[tables[b]].reshape(-1, *v_cache.shape[2:])[:n].float()
        o = F.scaled_dot_product_attention(q[b:b + 1, :, None].float(), keys.transpose(0, 1)[None],
                                           values.transpose(0, 1)[None], scale=scale, enable_gqa=True)
        out.append(o[0, :, 0])
    assert bs > 0
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_sdpa(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    blocks, bs, hkv, h, d = 40, 16, 4, 8, 64
    k_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    lens = torch.tensor([1, 17, 70, 5], dtype=torch.int32)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:5] for _ in range(4)])
    q = torch.randn(4, h, d, generator=g)
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    want = _reference_decode(q, k_cache, v_cache, tables, lens, d ** -0.5)
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_bf16_weight_linear_matches_f_linear() -> None:
    if not cpu_kernels.bf16_linear_available():
        pytest.skip("bf16 linear kernel not built for this CPU")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16).float()
    packed = cpu_kernels.pack_bf16_weight(w)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(cpu_kernels.linear_bf16w(x, packed), F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native", [True, False])
def test_decode_paths_match_hf(tiny_model: str, native: bool) -> None:
    prompts = random_prompts(8, 3, 60, seed=91)
    llm = LLM(tiny_model, dtype="float32", block_size=8, num_kv_blocks=256)
    runner = llm.engine.runner
    if native and not runner.native_decode:
        pytest.skip("no native kernel on this machine")
    runner.native_decode = native
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(tiny_model, prompts, 16)
