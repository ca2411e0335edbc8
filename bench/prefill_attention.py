#!/usr/bin/env python
"""Causal prefill attention on CPU: torch sdpa (``Attention.prefill_sdpa``) against the native
kernel (``cpu_kernels.prefill_attention``, straight from the paged cache) and against every query
row through the decode kernel (``cpu_kernels.decode_attention``: batch-invariant mode's prompt path,
and tuned mode's where ``cpu_kernels.prompt_rows_beat_sdpa``), in one run.

Kernel part: one layer's attention of one prefill step at the ``small`` model's shape (8 heads,
4 KV heads, head_dim 64, block size 16), the cache in ``--cache-dtype``, q in the compute dtype
(float32, or ``--q-dtype bfloat16``; the native kernel takes bf16 q on AMX only): prompts of 512,
1024 and 2048 tokens, 4 prompts of 512 in one step, and 512 new tokens after a cached prefix of
1024. Step part: a whole prefill step of the ``small`` model through the engine (tuned mode, the
compute dtype ``auto`` picks) with sdpa, with the decode kernel's rows and, where it serves that
dtype, with the native kernel, and the part of it spent in attention (all layers). Every figure is the
best of ``--reps`` repetitions (the machine may be shared and noisy). Example::

    PYTHONPATH=. python bench/prefill_attention.py --threads 2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

CASES = [("1 x 512", [512], 0), ("1 x 1024", [1024], 0), ("1 x 2048", [2048], 0), ("4 x 512", [512] * 4, 0),
         ("512 after 1024 cached", [512], 1024)]


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _step_inputs(lens: list[int], start: int, args: argparse.Namespace):
    """q, k, v of one step's prefill rows, a cache holding every sequence's K/V and the segments."""
    from pdserve.engine.layers.attention import Attention, PrefillSegment

    h, hkv, d, bs = 8, 4, 64, 16
    q_dtype, cache_dtype = getattr(torch, args.q_dtype), getattr(torch, args.cache_dtype)
    g = torch.Generator().manual_seed(0)
    total = sum(lens)
    qkv = torch.randn(total, (h + 2 * hkv) * d, generator=g).to(q_dtype)
    q = qkv[:, :h * d].view(total, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(total, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(total, hkv, d)
    attn = Attention(h, hkv, d)
    blocks_per_seq = -(-(start + max(lens)) // bs)
    attn.k_cache = torch.randn(len(lens) * blocks_per_seq, bs, hkv, d, generator=g).to(cache_dtype)
    attn.v_cache = torch.randn(len(lens) * blocks_per_seq, bs, hkv, d, generator=g).to(cache_dtype)
    segments, row = [], 0
    for i, n in enumerate(lens):
        ctx = start + n
        table = torch.arange(i * blocks_per_seq, i * blocks_per_seq + -(-ctx // bs))
        slots = (table[:, None] * bs + torch.arange(bs)).reshape(-1)[start:ctx]
        attn.k_cache.view(-1, hkv, d).index_copy_(0, slots, k[row:row + n].to(cache_dtype))
        attn.v_cache.view(-1, hkv, d).index_copy_(0, slots, v[row:row + n].to(cache_dtype))
        segments.append(PrefillSegment(row, row + n, ctx, table, q_dtype))   # (its mask, built on first use)
        row += n
    return attn, q, k, v, segments


def _row_tables(segments) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's block table and context length, as the backend builds them for its rows."""
    width = max(seg.block_table.numel() for seg in segments)
    tables, lens = [], []
    for seg in segments:
        n = seg.token_end - seg.token_start
        tables.append(torch.nn.functional.pad(seg.block_table, (0, width - seg.block_table.numel())).expand(n, -1))
        lens.append(torch.arange(seg.context_len - n + 1, seg.context_len + 1, dtype=torch.int32))
    return torch.cat(tables).contiguous(), torch.cat(lens)


def bench_kernel(args: argparse.Namespace) -> None:
    from pdserve.engine.layers import cpu_kernels

    print(f"one layer's prefill attention, small shape (H 8, HKV 4, D 64, bs 16), q {args.q_dtype}, "
          f"cache {args.cache_dtype}, {torch.get_num_threads()} threads, best of {args.reps}:")
    for name, lens, start in CASES:
        attn, q, k, v, segments = _step_inputs(lens, start, args)
        native = cpu_kernels.prefill_attention_supported(q.dtype, attn.k_cache, attn.head_dim)
        out = torch.empty(q.shape, dtype=q.dtype)
        tables, ctx = _row_tables(segments)

        def sdpa() -> None:
            for seg in segments:
                out[seg.token_start:seg.token_end] = attn.prefill_sdpa(q, k, v, seg)

        def kernel() -> None:
            for seg in segments:
                n = seg.token_end - seg.token_start
                cpu_kernels.prefill_attention(q[seg.token_start:seg.token_end], attn.k_cache, attn.v_cache,
                                              seg.block_table, seg.context_len - n, attn.scale,
                                              out[seg.token_start:seg.token_end])

        def rows() -> None:
            cpu_kernels.decode_attention(q, attn.k_cache, attn.v_cache, tables, ctx, attn.scale)

        t_sdpa, t_rows = _best(sdpa, args.reps), _best(rows, args.reps)
        line = f"  {name:<22} sdpa {t_sdpa:8.2f} ms   rows {t_rows:8.2f} ms   sdpa / rows {t_sdpa / t_rows:5.2f}"
        if native:
            t_kernel = _best(kernel, args.reps)
            line += f"   kernel {t_kernel:8.2f} ms   sdpa / kernel {t_sdpa / t_kernel:5.2f}"
        else:
            line += "   (no native prefill kernel for this q dtype here)"
        print(line, flush=True)


def bench_step(args: argparse.Namespace) -> None:
    from pdserve.engine import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.layers import cpu_kernels
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_maker import ensure_model

    engine = LLMEngine(EngineConfig.from_kwargs(str(ensure_model("small")), num_threads=args.threads, device="cpu",
                                                max_num_batched_tokens=2048, enable_prefix_caching=False,
                                                batch_invariant=False))   # tuned mode: its prompt path is chosen
    r = engine.runner
    print(f"whole prefill step, small model, backend {r.backend.name}, compute {r.compute_dtype}, best of "
          f"{args.reps}:")
    supported = cpu_kernels.prefill_attention_supported
    counter = iter(range(10**9))
    in_attention = [0.0]
    attention = r.backend.attention

    def timed_attention(*a):
        t0 = time.perf_counter()
        try:
            return attention(*a)
        finally:
            in_attention[0] += time.perf_counter() - t0

    r.backend.attention = timed_attention

    def step(lens: list[int]) -> tuple[float, float]:
        """ms of the one step that prefills fresh prompts of these lengths, and of its attention."""
        for n in lens:
            prompt = [(7 * next(counter)) % 8000 + 2 for _ in range(n)]
            engine.add_request(f"r{next(counter)}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        in_attention[0] = 0.0
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed * 1e3, in_attention[0] * 1e3

    rows_beat_sdpa = cpu_kernels.prompt_rows_beat_sdpa
    model = r.model_config
    arms = {"sdpa": (False, False), "rows": (False, True)}   # (native kernel, rows through the decode kernel)
    if supported(r.compute_dtype, r.kv_cache[0, 0], model.head_dim):
        arms["kernel"] = (True, False)
    for name, lens in (("1 x 512", [512]), ("1 x 1024", [1024]), ("1 x 2048", [2048]), ("4 x 512", [512] * 4)):
        line = f"  {name:<10}"
        for label, (native, rows) in arms.items():
            cpu_kernels.prefill_attention_supported = supported if native else (lambda *a: False)
            cpu_kernels.prompt_rows_beat_sdpa = lambda *a, on=rows: on
            total, attn = min(step(lens) for _ in range(args.reps + 1))
            if label == "sdpa":
                sdpa_total = total
            line += f"   {label} {total:7.1f} ms (attention {attn:6.1f})"
            if label != "sdpa":
                line += f" sdpa / {label} {sdpa_total / total:5.2f}"
        cpu_kernels.prefill_attention_supported, cpu_kernels.prompt_rows_beat_sdpa = supported, rows_beat_sdpa
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--q-dtype", default="float32")
    p.add_argument("--cache-dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-step", action="store_true", help="the kernel part only")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bench_kernel(args)
    if not args.no_step:
        bench_step(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
