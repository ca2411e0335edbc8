#!/usr/bin/env python
"""Roofline report: this machine's GEMM peak and memory bandwidth, a checkpoint's FLOPs and bytes
per step, and the floor they put under an offline workload's output tok/s.

Measured (best of ``--reps``, each at least ``--min-time`` s): torch.matmul GFLOP/s in bfloat16
and float32 at the model's prefill shapes (``--gemm-tokens`` rows times hidden x MLP, MLP x
hidden, hidden x hidden), on one thread and on all; memory copy GB/s (bytes read plus written,
``--copy-mib`` MiB), one thread and all. Counted from ``config.json`` (any Qwen3 / Llama
checkpoint, any preset): 2 FLOPs per weight per token in every linear layer, 4 * heads * head_dim
per key attended per layer (QK^T and AV; softmax and norms are not counted), the LM head on the
last prompt token only in prefill; a decode step reads every weight once (tied embeddings: the
LM head's) plus each sequence's KV cache. The workload (``--num-prompts``, ``--input-len``,
``--output-len``: a number or LO:HI for a uniform range, as vs_vllm.py's offline run) gives:
the compute floor (all FLOPs at the GEMM peak of ``--threads`` threads, in the model's dtype),
the decode memory floor at decode batch ``--batch`` (steps of weights plus KV read at the copy
bandwidth), the roofline floor (prefill at the peak, decode at the slower of the two) and the
serial floor (the linears at the peak, then the decode KV reads at the bandwidth: one thread
does one after the other);
``--measured-tok-s`` prints a measured figure as a fraction of each. ``--peak-gflops`` and
``--bandwidth-gbs`` skip the measurements. Example::

    PYTHONPATH=. python bench/roofline.py --model /tmp/qwen3-0.6b --num-prompts 16 \\
        --input-len 64:256 --output-len 32:64 --measured-tok-s 33.3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from pdserve.engine.model_config import ModelConfig  # noqa: E402 - torch-free

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelCost:
    """Per-token costs of one checkpoint, from its config."""

    linear_flops: int        # per token through every layer's linear layers
    lm_head_flops: int       # per token whose logits are computed
    attn_flops_per_key: int  # per token per key attended, all layers
    weight_bytes: int        # read once per decode step
    kv_bytes_per_token: int  # of cache, read per key attended

    def prefill_flops(self, n: int) -> int:
        """One prompt of n tokens (causal: token i attends i keys), logits for the last only."""
        return n * self.linear_flops + self.lm_head_flops + self.attn_flops_per_key * n * (n + 1) // 2

    def decode_flops(self, context: int) -> int:
        """One sequence's decode token attending ``context`` keys (itself included)."""
        return self.linear_flops + self.lm_head_flops + self.attn_flops_per_key * context

    def decode_step_bytes(self, batch: int, context: float) -> float:
        """A decode step of ``batch`` sequences each attending ``context`` keys."""
        return self.weight_bytes + batch * context * self.kv_bytes_per_token


def model_cost(cfg: ModelConfig) -> ModelCost:
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    layer_linear = h * q + 2 * h * kv + q * h + 3 * h * inter
    layer_norms = 2 * h + (2 * d if cfg.qk_norm else 0)
    layer_biases = (q + 2 * kv if cfg.qkv_bias else 0) + (h if cfg.attention_bias else 0) + \
        (2 * inter + h if cfg.mlp_bias else 0)
    lm_head = cfg.vocab_size * h
    if cfg.torch_dtype not in _ITEMSIZE:
        raise ValueError(f"torch_dtype {cfg.torch_dtype!r} is not one of {sorted(_ITEMSIZE)}")
    itemsize = _ITEMSIZE[cfg.torch_dtype]
    return ModelCost(
        linear_flops=2 * cfg.num_layers * layer_linear,
        lm_head_flops=2 * lm_head,
        attn_flops_per_key=4 * cfg.num_heads * d * cfg.num_layers,
        weight_bytes=(cfg.num_layers * (layer_linear + layer_norms + layer_biases) + h + lm_head) * itemsize,
        kv_bytes_per_token=2 * cfg.num_layers * kv * itemsize,
    )


def length_range(text: str) -> tuple[int, int]:
    """'N' or 'LO:HI' (inclusive) -> (LO, HI); ValueError naming the limit."""
    lo, _, hi = text.partition(":")
    bounds = (int(lo), int(hi or lo))
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"length range {text!r} must be N or LO:HI with 1 <= LO <= HI")
    return bounds


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]

    def mean(self, f, which: tuple[int, int]) -> float:
        """E[f(n)] for n uniform on the inclusive range."""
        values = range(which[0], which[1] + 1)
        return sum(f(n) for n in values) / len(values)

    @property
    def output_tokens(self) -> float:
        return self.num_prompts * self.mean(lambda m: m, self.output_len)


def decode_keys(w: Workload) -> float:
    """Keys the decode tokens of one prompt attend, in expectation. The first output token comes
    from the prefill; the j-th decode token attends n + j keys."""
    steps = w.mean(lambda m: m - 1, w.output_len)
    return w.mean(lambda n: n, w.input_len) * steps + w.mean(lambda m: (m - 1) * m / 2, w.output_len)


def workload_flops(c: ModelCost, w: Workload) -> tuple[float, float]:
    """(prefill, decode) FLOPs of the whole workload, in expectation."""
    prefill = w.num_prompts * w.mean(c.prefill_flops, w.input_len)
    steps = w.mean(lambda m: m - 1, w.output_len)
    decode = w.num_prompts * (steps * (c.linear_flops + c.lm_head_flops) + decode_keys(w) * c.attn_flops_per_key)
    return prefill, decode


def decode_bytes(c: ModelCost, w: Workload, batch: int) -> float:
    """Bytes the workload's decode steps read at decode batch ``batch``, at the mean context (the
    j-th of m - 1 decode tokens attends n + j keys: n + m / 2 on average)."""
    tokens = w.num_prompts * w.mean(lambda m: m - 1, w.output_len)
    context = w.mean(lambda n: n, w.input_len) + w.mean(lambda m: m, w.output_len) / 2
    return tokens / batch * c.decode_step_bytes(batch, context)


def floors(c: ModelCost, w: Workload, peak_flops: float, bandwidth: float, batch: int) -> dict[str, float]:
    """Output tok/s floors: compute, decode memory, roofline (prefill compute + decode's slower),
    and serial: one core in turn, every FLOP but decode attention's at the peak, then the decode
    steps' KV reads at the bandwidth (decode attention's FLOPs hidden behind them; the weights'
    reads hidden behind the linears' FLOPs). On one thread the serial floor is the one to reach:
    the KV stream and the GEMMs do not overlap."""
    prefill, decode = workload_flops(c, w)
    t_mem = decode_bytes(c, w, batch) / bandwidth
    t_roof = prefill / peak_flops + max(decode / peak_flops, t_mem)
    keys = w.num_prompts * decode_keys(w)
    t_serial = (prefill + decode - keys * c.attn_flops_per_key) / peak_flops + keys * c.kv_bytes_per_token / bandwidth
    out = w.output_tokens
    return {"compute": out * peak_flops / (prefill + decode), "decode_memory": out / t_mem if t_mem else float("inf"),
            "roofline": out / t_roof, "serial": out / t_serial}


# --------------------------------------------------------------------------- measurements


def _best_seconds(fn, reps: int, min_time: float) -> float:
    fn()   # warm up (allocation, kernel selection)
    best = float("inf")
    for _ in range(reps):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        best = min(best, elapsed / n)
    return best


def gemm_gflops(shapes: list[tuple[int, int, int]], dtype: str, threads: int, reps: int, min_time: float) -> float:
    """Best torch.matmul GFLOP/s over (m, k, n) shapes."""
    import torch
    torch.set_num_threads(threads)
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k).to(getattr(torch, dtype))
        b = torch.randn(k, n).to(getattr(torch, dtype))
        best = max(best, 2 * m * k * n / _best_seconds(lambda: torch.matmul(a, b), reps, min_time) / 1e9)
    return best


def copy_gbs(mib: int, threads: int, reps: int, min_time: float) -> float:
    """dst.copy_(src) GB/s, counting the bytes read and the bytes written."""
    import torch
    torch.set_num_threads(threads)
    src = torch.ones(mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), reps, min_time) / 1e9


def measure(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    m, h, inter = args.gemm_tokens, cfg.hidden_size, cfg.intermediate_size
    shapes = [(m, h, inter), (m, inter, h), (m, h, h)]
    threads = {"1 thread": 1, f"{os.cpu_count()} threads": os.cpu_count() or 1}
    out: dict[str, dict[str, float]] = {}
    for label, n in threads.items():
        out[label] = {f"{dt}_gflops": gemm_gflops(shapes, dt, n, args.reps, args.min_time)
                      for dt in ("bfloat16", "float32")}
        out[label]["copy_gbs"] = copy_gbs(args.copy_mib, n, args.reps, args.min_time)
    return out


# --------------------------------------------------------------------------- report


def build_parser() -> argparse.ArgumentParser:
    p = drivers.parser(__doc__)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the small model)")
    drivers.add_flags(p, num_prompts=64, input_len="64:512", output_len="64:256", threads=1, batch=0,
                      gemm_tokens=512, copy_mib=256, reps=3, min_time=0.3)
    p.add_argument("--measured-tok-s", type=float, default=None, help="a measured output tok/s to rate")
    p.add_argument("--peak-gflops", type=float, default=None, help="GEMM peak to use instead of measuring")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="copy bandwidth to use instead of measuring")
    p.add_argument("--json", action="store_true", help="print one JSON line too")
    return p


def _print_costs(c: ModelCost, cfg: ModelConfig, w: Workload) -> None:
    n = round(w.mean(lambda x: x, w.input_len))
    print(f"model: {cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"{cfg.torch_dtype}; weights read per decode step {c.weight_bytes / 1e6:.1f} MB, "
          f"KV {c.kv_bytes_per_token / 1024:.1f} KiB per token")
    print(f"per prefill token (prompt of {n}): {c.prefill_flops(n) / n / 1e6:.1f} MFLOP; "
          f"per decode token at context {n}: {c.decode_flops(n) / 1e6:.1f} MFLOP, "
          f"{c.decode_step_bytes(1, n) / 1e6:.1f} MB read at batch 1")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ModelConfig.from_dir(drivers.model_dir(args.model))
    w = Workload(args.num_prompts, length_range(args.input_len), length_range(args.output_len))
    c = model_cost(cfg)
    _print_costs(c, cfg, w)
    measured = {} if args.peak_gflops and args.bandwidth_gbs else measure(cfg, args)
    for label, figures in measured.items():
        print(f"{label}: bf16 GEMM {figures['bfloat16_gflops']:.0f} GFLOP/s, float32 GEMM "
              f"{figures['float32_gflops']:.0f} GFLOP/s, copy {figures['copy_gbs']:.1f} GB/s")
    row = measured.get("1 thread" if args.threads == 1 else f"{os.cpu_count()} threads", {})
    dtype = "bfloat16" if cfg.torch_dtype in ("bfloat16", "float16") else "float32"
    peak = args.peak_gflops or row[f"{dtype}_gflops"]
    bandwidth = args.bandwidth_gbs or row["copy_gbs"]
    batch = args.batch or min(args.num_prompts, 256)
    result = floors(c, w, peak * 1e9, bandwidth * 1e9, batch)
    prefill, decode = workload_flops(c, w)
    print(f"workload: {w.num_prompts} prompts, in {args.input_len}, out {args.output_len}: "
          f"{w.output_tokens:.0f} output tokens, {(prefill + decode) / 1e12:.3f} TFLOP "
          f"({prefill / 1e12:.3f} prefill); {args.threads} thread(s) at {peak:.0f} GFLOP/s, {bandwidth:.1f} GB/s")
    for name, tok_s in result.items():
        rated = f" -> measured {args.measured_tok_s:g} is {args.measured_tok_s / tok_s:.1%} of it" \
            if args.measured_tok_s else ""
        at = f" (decode batch {batch})" if name in ("decode_memory", "roofline") else ""
        print(f"{name} floor{at}: {tok_s:.1f} output tok/s{rated}")
    if args.json:
        print(json.dumps({"cost": asdict(c), "measured": measured, "peak_gflops": peak, "bandwidth_gbs": bandwidth,
                          "batch": batch, "floors_tok_s": result, "measured_tok_s": args.measured_tok_s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
