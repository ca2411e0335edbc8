"""The native CPU kernels agree with the torch paths they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import LLM, SamplingParams, cpu_features
from pdserve.engine.cpu_features import CpuFeatures, detect, invariant_kernels_are_fastest
from pdserve.engine.layers import cpu_kernels
from pdserve.engine.layers.backend import TorchBackend
from pdserve.engine.model_maker import make_model
from tests.conftest import hf_greedy, random_prompts

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler: torch paths only")
needs_amx = pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.amx_available(), reason="no AMX on this CPU")
needs_bf16_linear = pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.bf16_linear_available(),
                                       reason="bf16 linear kernel not built for this CPU")
needs_bf16dot = pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.bf16dot_available(),
                                   reason="no AVX512-BF16 on this CPU (or no C++ compiler)")
needs_avx2 = pytest.mark.skipif(cpu_kernels.load() is None or not detect().avx2_fma,
                                reason="no C++ compiler or no AVX2 + FMA on this CPU")


def _greedy_logits(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of prompts and every logits row the model computed for them (float32), in
    the order the steps computed them. Callers compare two engines' rows by position, so the
    schedule must not depend on timing: prompt_order "shortest" keys prompts by arrival time and
    the learned prefill speed, and under load once batched a run's prompts differently."""
    assert llm.engine.config.prompt_order == "fcfs", "rows compared by position need a schedule free of timing"
    runner = llm.engine.runner
    captured: list[torch.Tensor] = []
    real = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.append(real(h).float()) or captured[-1]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs], torch.cat(captured)


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
@pytest.mark.parametrize("h,hkv,d,bs", [(8, 4, 64, 16), (4, 4, 64, 16), (8, 2, 64, 16), (8, 1, 128, 16),
                                        (6, 3, 64, 5), (4, 2, 80, 16), (9, 3, 64, 16), (15, 3, 128, 16),
                                        (12, 2, 64, 16), (14, 2, 64, 8), (3, 1, 64, 16)])
def test_decode_attention_matches_sdpa(dtype: torch.dtype, h: int, hkv: int, d: int, bs: int) -> None:
    """Every GQA group size the vectorized kernels take (1 to 8; the AVX-512 kernel pads 3 to 4
    and 5-7 to 8 query heads: SmolLM2's 9 over 3 is a group of 3), head dims 64 and 128, a block
    size that is not a multiple of 8, and a shape they leave to the generic kernel (D 80); context
    lengths inside a block, on its boundary and across several blocks."""
    g = torch.Generator().manual_seed(0)
    blocks = 40
    k_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    lens = torch.tensor([1, 17, 70, 5, 2 * bs, 8 * bs + 3], dtype=torch.int32)
    per_row = max(-(-int(n) // bs) for n in lens)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:per_row] for _ in range(len(lens))])
    q = torch.randn(len(lens), h, d, generator=g)
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    want = _reference_decode(q, k_cache, v_cache, tables, lens, d ** -0.5)
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)


@needs_bf16_linear
def test_bf16_weight_linear_matches_f_linear() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16).float()
    packed = cpu_kernels.pack_bf16_weight(w)
    for rows in (1, 3, 4, 5, 8, 12, 13, 17, 200):   # row tiles of 4 (AVX2) / 12 (AVX-512), buffered or not
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(cpu_kernels.linear_bf16w(x, packed), F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native", [True, False])
def test_decode_paths_match_hf(tiny_model: str, native: bool) -> None:
    prompts = random_prompts(8, 3, 60, seed=91)
    llm = LLM(tiny_model, dtype="float32", block_size=8, num_kv_blocks=256)
    runner = llm.engine.runner
    if native and runner.backend.name != "native-cpu":
        pytest.skip("no native kernel on this machine")
    if not native:
        runner.set_backend(TorchBackend())
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(tiny_model, prompts, 16)


@needs_bf16dot
def test_bf16_dot_linear_matches_f_linear_and_each_row_is_its_own() -> None:
    """bf16 rows x bf16 weights: F.linear's float32 result within rounding (a bf16 result rounded
    as torch rounds), columns padded to 32 and sliced back, and a row's output the same bits alone
    as among others: every row count, row tiles of 12, and at K = 4200 the blocks of 1024 k pairs
    (the last one partial) that more than one row tile runs, against one tile's unblocked chain,
    across a chunk boundary (768 KiB of x at a block of 1024 pairs is 192 rows)."""
    g = torch.Generator().manual_seed(2)
    for n, k in ((96, 64), (40, 4200)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        packed = cpu_kernels.pack_bf16dot_weight(w)
        x = torch.randn(200, k, generator=g).to(torch.bfloat16)
        full = cpu_kernels.linear_bf16dot(x, packed)[:, :n]
        torch.testing.assert_close(full, F.linear(x.float(), w.float()), rtol=1e-3, atol=1e-3)
        rounded = cpu_kernels.linear_bf16dot(x, packed, torch.bfloat16)[:, :n]   # as .to(torch.bfloat16) rounds
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, full.to(torch.bfloat16))
        for rows in (1, 5, 12, 13, 64, 65, 193):
            assert torch.equal(cpu_kernels.linear_bf16dot(x[:rows], packed)[:, :n], full[:rows]), rows
            assert torch.equal(cpu_kernels.linear_bf16dot(x[rows:rows + 1], packed)[:, :n], full[rows:rows + 1])
    assert cpu_kernels.pack_bf16dot_weight(torch.randn(32, 63)) is None   # K odd: no pairs
    w = torch.randn(100, 64, generator=g).to(torch.bfloat16)                # 100 columns: padded to 128
    assert torch.equal(cpu_kernels.unpack_bf16dot_weight(cpu_kernels.pack_bf16dot_weight(w), 100), w)


# ---- fused elementwise kernels against the torch backend ------------------------------------

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: summation order only; bf16: at most one bf16 rounding step apart.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm_match_torch(dtype: torch.dtype) -> None:
    from pdserve.engine.layers.backend import NativeCpuBackend
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 200, generator=g).to(dtype)            # 200: a masked tail past 12 full vectors
    res = torch.randn(7, 200, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(200, generator=g)).to(dtype)
    torch_be, native = TorchBackend(), NativeCpuBackend()
    _close(native.rms_norm(x, w, 1e-6), torch_be.rms_norm(x, w, 1e-6), dtype)
    out_t, res_t = torch_be.add_rms_norm(x, res.clone(), w, 1e-6)
    out_n, res_n = native.add_rms_norm(x, res.clone(), w, 1e-6)
    assert torch.equal(res_n, res_t)                           # the residual add rounds identically
    _close(out_n, out_t, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    from pdserve.engine.layers.backend import NativeCpuBackend
    g = torch.Generator().manual_seed(3)
    gate_up = 4 * torch.randn(5, 2 * 136, generator=g)
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -30.0, -1e-3, 0.0, 30.0, 90.0, 200.0])   # exp's clamps
    gate_up = gate_up.to(dtype)
    _close(NativeCpuBackend().silu_mul(gate_up, 136), TorchBackend().silu_mul(gate_up, 136), dtype)


@needs_kernels
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qkv_rope_store_matches_torch(dtype: torch.dtype, cache_dtype: torch.dtype, qk_norm: bool) -> None:
    from types import SimpleNamespace

    from pdserve.engine.layers.attention import Attention, AttentionMetadata
    from pdserve.engine.layers.backend import NativeCpuBackend
    from pdserve.engine.layers.norm import RMSNorm
    from pdserve.engine.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(4)
    nq, nkv, d, rows, blocks, bs = 4, 2, 64, 6, 8, 4
    rot = RotaryEmbedding(d, 128, 10000.0).to(dtype)
    norms = [RMSNorm(d, 1e-6).to(dtype) for _ in range(2)]
    for n in norms:
        n.weight.data = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    qkv = torch.randn(rows, (nq + 2 * nkv) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 17, 3, 100, 127])
    slots = torch.tensor([3, 9, 10, 0, 31, 17])
    results = []
    for backend in (TorchBackend(), NativeCpuBackend()):
        attn = Attention(nq, nkv, d)
        attn.k_cache = torch.zeros(blocks, bs, nkv, d, dtype=cache_dtype)
        attn.v_cache = torch.zeros(blocks, bs, nkv, d, dtype=cache_dtype)
        layer = SimpleNamespace(num_heads=nq, num_kv_heads=nkv, head_dim=d, q_size=nq * d, kv_size=nkv * d,
                                q_norm=norms[0] if qk_norm else None, k_norm=norms[1] if qk_norm else None,
                                rotary=rot, attn=attn)
        q, k, v = backend.qkv_rope_store(layer, qkv.clone(), positions, AttentionMetadata(slot_mapping=slots))
        results.append((q, k, v, attn.k_cache, attn.v_cache))
    for got, want in zip(results[1], results[0]):
        _close(got, want, dtype)


@needs_kernels
def test_decode_attention_bf16_q_and_strided_rows() -> None:
    g = torch.Generator().manual_seed(5)
    blocks, bs, hkv, h, d = 30, 16, 4, 8, 64
    k_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(torch.bfloat16)
    lens = torch.tensor([3, 40, 33], dtype=torch.int32)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:3] for _ in range(3)])
    qkv = torch.randn(3, (h + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    q = qkv[:, :h * d].view(3, h, d)                           # rows (h + 2 hkv) * d apart
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    assert got.dtype == torch.bfloat16
    want = _reference_decode(q.float(), k_cache, v_cache, tables, lens, d ** -0.5)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@needs_amx
def test_amx_linear_matches_f_linear() -> None:
    g = torch.Generator().manual_seed(6)
    w = torch.randn(192, 96, generator=g).to(torch.bfloat16)
    bias = torch.randn(192, generator=g).to(torch.bfloat16)
    packed = cpu_kernels.pack_amx_weight(w)
    for rows in (1, 7, 16, 17, 40, 64):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        want = (x.float() @ w.float().T + bias.float())
        torch.testing.assert_close(cpu_kernels.amx_linear(x, packed, bias).float(), want, rtol=1e-2, atol=2e-2)


@needs_kernels
def test_native_backend_matches_torch_backend_in_bf16(tiny_qwen3: str) -> None:
    """bf16 compute: the native and torch backends agree within bf16 tolerance on the logits of a
    mixed batch (prefill + decode rows)."""
    prompts = random_prompts(4, 5, 40, seed=12)
    logits = []
    for native in (True, False):
        llm = LLM(tiny_qwen3, dtype="bfloat16", compute_dtype="bfloat16", block_size=8, num_kv_blocks=64,
                  prompt_order="fcfs")
        runner = llm.engine.runner
        if native and runner.backend.name != "native-cpu":
            pytest.skip("no native kernels on this machine")
        if not native:
            runner.set_backend(TorchBackend())
        logits.append(_greedy_logits(llm, prompts, 4)[1])
    assert logits[0].shape == logits[1].shape
    scale = logits[1].abs().max()
    assert (logits[0] - logits[1]).abs().max() <= 0.05 * scale


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_sampler_matches_torch_sampler(dtype: torch.dtype) -> None:
    from pdserve.engine.layers.sampler import Sampler
    g = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(12, 1000, generator=g)).to(dtype)
    params = [SamplingParams(temperature=[0.0, 0.6, 1.3][i % 3], seed=50 + i,
                             top_k=40 if i == 4 else 0, top_p=0.9 if i == 7 else 1.0) for i in range(12)]
    index = list(range(12))
    want = Sampler(0, native=False)(logits, params, index)
    got = Sampler(0, native=True)(logits, params, index)
    assert got == want
    # seeded rows do not depend on the batch around them
    alone = Sampler(0, native=True)(logits[5:6], params[5:6], index[5:6])
    assert alone == got[5:6]


@needs_kernels
@pytest.mark.parametrize("start,n", [(0, 1), (0, 37), (0, 130), (21, 50), (64, 64), (100, 3)])
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_attention_matches_sdpa(start: int, n: int, d: int) -> None:
    if not cpu_kernels.prefill_attention_supported(torch.bfloat16, torch.empty(0, dtype=torch.bfloat16), d):
        pytest.skip("no AMX on this CPU")
    g = torch.Generator().manual_seed(8)
    blocks, bs, hkv, h = 24, 16, 2, 4
    ctx = start + n
    k_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=g)[:-(-ctx // bs)]
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    q = qkv[:, :h * d].view(n, h, d)
    out = torch.empty(n, h, d, dtype=torch.bfloat16)
    cpu_kernels.prefill_attention(q, k_cache, v_cache, table, start, d ** -0.5, out)
    keys = k_cache[table].reshape(-1, hkv, d)[:ctx].float()
    values = v_cache[table].reshape(-1, hkv, d)[:ctx].float()
    allowed = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
    want = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                          values.transpose(0, 1)[None], attn_mask=allowed, scale=d ** -0.5,
                                          enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def _reference_prefill(q, k_cache, v_cache, table, start, scale):
    """Causal attention over the paged cache in float64: [n, H, D]."""
    n, h, d = q.shape
    hkv = k_cache.shape[2]
    ctx = start + n
    keys = k_cache[table].reshape(-1, hkv, d)[:ctx].double().repeat_interleave(h // hkv, 1)
    values = v_cache[table].reshape(-1, hkv, d)[:ctx].double().repeat_interleave(h // hkv, 1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), keys) * scale
    future = torch.arange(ctx)[None, :] > torch.arange(start, ctx)[:, None]
    return torch.einsum("hnk,khd->nhd", scores.masked_fill(future, float("-inf")).softmax(-1), values)


@needs_avx2
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_avx2_prefill_attention_matches_reference(d: int, group: int, cache_dtype: torch.dtype,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 q over a float32 / bf16 cache on AVX2 + FMA, 2 threads (split over KV heads with 2 of
    them, over query rows with 1): no cached prefix and a cached one, query counts off the tile
    sizes (6 queries, 16 and 64 keys), block sizes 8 and 16, q rows strided inside fused qkv rows."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert cpu_kernels.prefill_attention_supported(torch.float32, torch.empty(0, dtype=cache_dtype), d)
    g = torch.Generator().manual_seed(10 + d + group)
    hkv = 1 if group == 4 else 2
    h = hkv * group
    for start, n in [(0, 1), (0, 5), (0, 67), (0, 200), (21, 50), (64, 64), (100, 3), (37, 131)]:
        for bs in (8, 16):
            ctx = start + n
            blocks = -(-ctx // bs) + 4
            k_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(cache_dtype)
            v_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(cache_dtype)
            table = torch.randperm(blocks, generator=g)[:-(-ctx // bs)]
            qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g)
            q = qkv[:, :h * d].view(n, h, d)
            out = torch.full((n, h, d), float("nan"))
            cpu_kernels.prefill_attention(q, k_cache, v_cache, table, start, d ** -0.5, out)
            want = _reference_prefill(q, k_cache, v_cache, table, start, d ** -0.5)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, msg=f"start {start}, n {n}, bs {bs}")


def test_prefill_parts_cover_every_row_and_head() -> None:
    for n, start, h, hkv, threads in [(2048, 0, 8, 4, 2), (2048, 0, 8, 1, 2), (512, 1024, 8, 2, 4), (10, 0, 4, 1, 2),
                                      (100, 5, 4, 4, 3)]:
        parts = cpu_kernels._prefill_parts(n, start, h, hkv, threads)
        assert 1 <= len(parts) <= 2 * threads
        covered = torch.zeros(n, h, dtype=torch.int64)
        for h0, h1, a, b in parts:
            assert h0 % (h // hkv) == 0 and h1 % (h // hkv) == 0
            covered[a:b, h0:h1] += 1
        assert bool((covered == 1).all()), (n, start, h, hkv, threads)


@needs_kernels
def test_prompt_rows_beat_sdpa_for_bf16_q_on_the_avx512_kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    for flags, want in [(avx512, True), (avx512 - {"avx512bw"}, False), ({"avx2", "fma"}, False)]:
        monkeypatch.setattr(cpu_kernels, "detect", lambda: CpuFeatures("test", frozenset(flags)))
        assert cpu_kernels.prompt_rows_beat_sdpa(torch.bfloat16, bf16, 64) == want
        assert cpu_kernels.prompt_rows_beat_sdpa(torch.bfloat16, bf16, 128) == want
        assert not cpu_kernels.prompt_rows_beat_sdpa(torch.bfloat16, bf16, 80)     # the generic kernel
        assert not cpu_kernels.prompt_rows_beat_sdpa(torch.float32, bf16, 64)      # the native prefill kernels'


@needs_kernels
def test_prefill_attention_supported_follows_cpu_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 q runs natively exactly where the CPU has AVX2 and FMA; bf16 q only on AMX."""
    bf16, f32 = torch.empty(0, dtype=torch.bfloat16), torch.empty(0)
    for flags, want in [({"avx2", "fma"}, True), ({"avx2"}, False), (set(), False)]:
        monkeypatch.setattr(cpu_kernels, "detect", lambda: CpuFeatures("test", frozenset(flags)))
        monkeypatch.setattr(cpu_kernels, "_avx2_prefill", None)
        assert cpu_kernels.prefill_attention_supported(torch.float32, bf16, 64) == want
        assert cpu_kernels.prefill_attention_supported(torch.float32, f32, 128) == want
        assert not cpu_kernels.prefill_attention_supported(torch.float32, bf16, 80)
    monkeypatch.setattr(cpu_kernels, "_avx2_prefill", None)
    monkeypatch.undo()
    assert cpu_kernels.prefill_attention_supported(torch.float32, bf16, 64) == detect().avx2_fma
    assert cpu_kernels.prefill_attention_supported(torch.bfloat16, bf16, 64) == cpu_kernels.amx_available()


@pytest.fixture(scope="module")
def tiny_d64(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_model(tmp_path_factory.mktemp("models") / "tiny-d64", preset="tiny-d64", arch="qwen3"))


def _count_prefill_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    starts: list[int] = []
    real = cpu_kernels.prefill_attention

    def spy(q, k_cache, v_cache, table, start, scale, out):
        starts.append(start)
        real(q, k_cache, v_cache, table, start, scale, out)

    monkeypatch.setattr(cpu_kernels, "prefill_attention", spy)
    return starts


@needs_avx2
def test_native_prefill_attention_greedy_matches_hf(tiny_d64: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 compute and cache: the engine's prefills (whole prompts, chunked ones and prompts
    after a cached prefix) go through the native kernel and greedy tokens equal HF's."""
    prefix = random_prompts(1, 40, 40, seed=21)[0]
    prompts = random_prompts(4, 3, 90, seed=20) + [prefix + t for t in random_prompts(3, 2, 30, seed=22)]
    llm = LLM(tiny_d64, dtype="float32", block_size=8, num_kv_blocks=256, max_num_batched_tokens=64,
              batch_invariant=False)   # (batch-invariant mode attends through the decode kernel)
    assert llm.engine.runner.backend.name == "native-cpu"
    starts = _count_prefill_calls(monkeypatch)
    outs = llm.generate(prompts[:5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outs += llm.generate(prompts[5:], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(tiny_d64, prompts, 12)
    assert 0 in starts and any(s > 0 for s in starts)
    assert all(o.num_cached_tokens == 40 for o in outs[5:])


@needs_avx2
def test_native_prefill_attention_over_bf16_cache_matches_torch_backend(tiny_d64: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 compute over a bf16 cache (the small model's setting here): the native prefill
    attention and sdpa see the same bf16-rounded K/V and agree to float32 rounding, but a later
    layer's K/V may round to the neighbouring bf16 value: same greedy tokens, logits within 1%."""
    prompts = random_prompts(3, 20, 70, seed=23)
    logits, tokens = [], []
    for native in (True, False):
        llm = LLM(tiny_d64, dtype="bfloat16", compute_dtype="float32", block_size=8, num_kv_blocks=64,
                  max_num_batched_tokens=48, batch_invariant=False, prompt_order="fcfs")
        runner = llm.engine.runner
        assert runner.backend.name == "native-cpu"
        starts = _count_prefill_calls(monkeypatch)
        if not native:
            monkeypatch.setattr(cpu_kernels, "prefill_attention_supported", lambda *args: False)
        out_tokens, out_logits = _greedy_logits(llm, prompts, 6)
        tokens.append(out_tokens)
        logits.append(out_logits)
        assert bool(starts) == native
        monkeypatch.undo()
    assert tokens[0] == tokens[1]
    assert (logits[0] - logits[1]).abs().max() <= 0.01 * logits[1].abs().max()


AMX_FLAGS = frozenset({"amx_bf16", "amx_tile", "amx_int8"})


def _as_if_without_amx(monkeypatch) -> None:
    """The engine decides its kernels as on this CPU without AMX (an AVX512-BF16 Xeon runs the
    other CPU families' bf16 paths)."""
    f = detect()
    monkeypatch.setattr(cpu_features, "detect", lambda: CpuFeatures(f.model, f.flags - AMX_FLAGS, f.machine))
    monkeypatch.setattr(cpu_kernels, "detect", cpu_features.detect)
    monkeypatch.setattr(cpu_kernels, "amx_available", lambda: False)   # nor its AMX prefill attention


def _tuned_mode_runs_bf16dot() -> bool:
    """Without AMX (faked where it is there): whether tuned mode takes linear_bf16dot."""
    f = detect()
    return cpu_kernels.bf16dot_available() and invariant_kernels_are_fastest(
        CpuFeatures(f.model, f.flags - AMX_FLAGS, f.machine), torch.bfloat16, False)


@needs_kernels
@pytest.mark.parametrize("batch_invariant,kind", [(False, "amx"), (True, "amx"), (True, "bf16dot"), (False, "bf16dot")],
                         ids=["tuned-amx", "invariant-amx", "invariant-bf16dot", "tuned-bf16dot"])
def test_fused_decode_step_equals_layer_by_layer(tiny_qwen3: str, batch_invariant: bool, kind: str,
                                                 monkeypatch) -> None:
    """The one-call decode step runs the same kernels in the same order as the per-op native
    path: identical logits, bit for bit. Its linears: the AMX kernel in tuned mode on AMX and in
    batch-invariant mode there (where a decode row must not depend on which path its step took),
    linear_bf16dot in batch-invariant mode without AMX and in tuned mode where that is the CPU's
    fastest GEMM. The bf16dot cases run on an AMX CPU too, as if it had none."""
    available = {"amx": cpu_kernels.amx_available(),
                 "bf16dot": _tuned_mode_runs_bf16dot() if not batch_invariant else cpu_kernels.bf16dot_available()}[kind]
    if not available:
        pytest.skip(f"this CPU's {'batch-invariant' if batch_invariant else 'tuned'} mode has no native {kind} GEMM")
    if kind == "bf16dot":
        _as_if_without_amx(monkeypatch)
    prompts = random_prompts(3, 5, 30, seed=13)
    logits, used = [], []
    for fused in (True, False):
        llm = LLM(tiny_qwen3, dtype="bfloat16", compute_dtype="bfloat16", block_size=8, num_kv_blocks=64,
                  num_threads=1, batch_invariant=batch_invariant, prompt_order="fcfs")
        runner = llm.engine.runner
        assert runner.backend.name == "native-cpu" and runner.batch_invariant == batch_invariant
        if not fused:
            runner.backend.decode_model = lambda *args: None
        logits.append(_greedy_logits(llm, prompts, 5)[1])
        used.append([f.linear_kind for f in getattr(runner.backend, "_fused", {}).values() if f is not None])
    assert used == [[kind], []]
    assert torch.equal(logits[0], logits[1])


@needs_kernels
def test_tuned_mode_runs_the_invariant_kernels_where_they_are_the_fastest(tiny_d64: str, monkeypatch) -> None:
    """bf16 on AVX512-BF16 without AMX (faked on an AMX CPU): tuned mode packs every linear for
    linear_bf16dot (no oneDNN copy), attends prompts through the decode kernel (never sdpa) and
    decodes in the fused call. Those are batch-invariant mode's kernels: its logits, bit for bit,
    without its promise."""
    if not _tuned_mode_runs_bf16dot():
        pytest.skip("this CPU has no AVX512-BF16: tuned mode keeps its own kernels")
    _as_if_without_amx(monkeypatch)
    from pdserve.engine.layers.attention import Attention
    from pdserve.engine.layers.linear import Linear

    def no_sdpa(*args):
        raise AssertionError("a prompt attended through sdpa")
    monkeypatch.setattr(Attention, "prefill_sdpa", no_sdpa)
    prompts = random_prompts(3, 20, 60, seed=15)
    logits, tokens = [], []
    for invariant in (True, False):
        llm = LLM(tiny_d64, dtype="bfloat16", compute_dtype="bfloat16", block_size=8, num_kv_blocks=128,
                  max_num_batched_tokens=48, num_threads=1, batch_invariant=invariant, prompt_order="fcfs")
        runner = llm.engine.runner
        assert runner.batch_invariant == invariant and runner.backend.name == "native-cpu"
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.invariant_kernel == "bf16dot" and m.packed is None and m.weight is None for m in linears)
        out_tokens, out_logits = _greedy_logits(llm, prompts, 6)
        tokens.append(out_tokens)
        logits.append(out_logits)
        assert any(f is not None for f in runner.backend._fused.values())
    assert tokens[0] == tokens[1]
    assert torch.equal(logits[0], logits[1])


@needs_amx
def test_amx_int8_linear_matches_w8a16_torch_path() -> None:
    from pdserve.engine.layers.linear import Linear
    g = torch.Generator().manual_seed(9)
    lin = Linear(96, 128, bias=True).to(torch.bfloat16)
    lin.weight.data = torch.randn(128, 96, generator=g).to(torch.bfloat16)
    lin.bias.data = torch.randn(128, generator=g).to(torch.bfloat16)
    lin.quantize_w8a16()
    assert lin.pack_for_cpu(amx=True) and lin.packed_amx.dtype == torch.int8
    for rows in (1, 9, 33):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        torch.testing.assert_close(lin(x).float(), lin._forward_w8a16(x).float(), rtol=1e-2, atol=2e-2)


@needs_kernels
def test_w8a16_native_matches_torch_backend_in_bf16(tiny_qwen3: str) -> None:
    prompts = random_prompts(3, 5, 30, seed=14)
    logits = []
    for native in (True, False):
        llm = LLM(tiny_qwen3, dtype="bfloat16", compute_dtype="bfloat16", quantization="w8a16", block_size=8,
                  num_kv_blocks=64, num_threads=1, batch_invariant=False,   # the tuned paths, as on AMX
                  prompt_order="fcfs")
        runner = llm.engine.runner
        if native and runner.backend.name != "native-cpu":
            pytest.skip("no native kernels on this machine")
        if not native:
            runner.set_backend(TorchBackend())
            for m in runner.model.modules():
                if hasattr(m, "packed_amx"):
                    m.packed_amx = None
        logits.append(_greedy_logits(llm, prompts, 4)[1])
    assert (logits[0] - logits[1]).abs().max() <= 0.05 * logits[1].abs().max()


def test_top_k_and_top_p_by_partial_selection_equal_a_sort_of_the_vocabulary() -> None:
    """The filter keeps the same tokens with the same probabilities as sorting the whole row
    (top-k, top-p over the renormalized rest), at a Qwen3-sized vocabulary: top-k alone, top-p
    alone (its mass inside the candidates, and a flat row where it is not), and both."""
    from pdserve.engine.layers.sampler import TOP_P_CANDIDATES, Sampler

    def by_sort(scaled: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        values, ids = scaled.sort(descending=True)
        k = p.top_k if p.top_k > 0 else scaled.numel()
        probs = values.masked_fill(torch.arange(scaled.numel()) >= k, float("-inf")).softmax(dim=-1)
        probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) > p.top_p, 0.0)
        return torch.zeros_like(probs).scatter_(0, ids, probs)
    g = torch.Generator().manual_seed(5)
    vocab = 151_936
    rows = torch.randn(5, vocab, generator=g) * 4
    rows[3] = torch.randn(vocab, generator=g) * 0.01   # flat: top-p needs more than the candidates
    params = [SamplingParams(top_k=50), SamplingParams(top_p=0.9), SamplingParams(top_k=3000, top_p=0.5),
              SamplingParams(top_p=0.95), SamplingParams(top_k=1)]
    got = Sampler._filter(rows, params)
    for i, p in enumerate(params):
        want = by_sort(rows[i], p)
        assert torch.equal(got[i] > 0, want > 0), i
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-6)   # float32 sums in another order
    assert (got[3] > 0).sum() > TOP_P_CANDIDATES   # the flat row's top-p took the sort
