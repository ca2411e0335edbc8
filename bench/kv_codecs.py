"""KV wire codecs on real KV: ratio, encode/decode MB/s and break-even link rate per codec.

Runs a 1200-token prompt through the small model, reads its KV blocks out of the pool (as the
prefill worker does), then times the codecs of services/kv_transfer/wire_codec.py and the
alternatives they were chosen against (zstd 1/3, lz4, zlib 1, over the raw bytes and over the
high byte plane only). Prints; not a test.

    pdserve make-model /tmp/pdhome/small --preset small   # once
    python bench/kv_codecs.py --model /tmp/pdhome/small
"""
from __future__ import annotations

import argparse
import random
import subprocess
import time
import zlib
from typing import Callable

import numpy as np
import torch
import zstandard

from pdserve.engine import LLM, SamplingParams
from pdserve.services.kv_transfer import wire_codec as kc


def real_kv(model: str, tokens: int, seed: int) -> torch.Tensor:
    """[blocks, layers, 2, block_size, heads, head_dim] of one prompt's full blocks."""
    with LLM(model) as llm:
        rng = random.Random(seed)
        ids = [rng.randrange(10, llm.engine.model_config.vocab_size) for _ in range(tokens)]
        llm.generate([ids], SamplingParams(max_tokens=1))
        bm = llm.engine.block_manager
        return llm.engine.runner.read_blocks([bm.hash_to_block[h] for h in bm.computed_prefix_blocks(ids)])


def _hi(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b.reshape(-1, 2)[:, 1])


def alternatives() -> dict[str, tuple[Callable[[np.ndarray], int], bool]]:
    """name -> (compressed size of one block, whether it compresses the high plane only)."""
    z1, z3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    codecs: dict[str, Callable[[bytes], bytes]] = {"zstd-1": z1.compress, "zstd-3": z3.compress,
                                                   "zlib-1": lambda x: zlib.compress(x, 1)}
    try:
        import lz4.block
        codecs["lz4"] = lambda x: lz4.block.compress(x, store_size=False)
    except ImportError:
        pass
    out: dict[str, tuple[Callable[[np.ndarray], int], bool]] = {}
    for name, fn in codecs.items():
        out[f"{name} raw bytes"] = ((lambda b, fn=fn: len(fn(b))), False)
        out[f"{name} high plane"] = ((lambda b, fn=fn: len(fn(_hi(b))) + b.nbytes // 2), True)
    return out


def best_of(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/pdhome/small")
    ap.add_argument("--tokens", type=int, default=1200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cpu = [ln for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
           if ln.startswith("Model name")]
    print(cpu[0] if cpu else "Model name: unknown")
    kv = real_kv(args.model, args.tokens, seed=0)
    dtype = str(kv.dtype).removeprefix("torch.")
    shape = tuple(kv.shape[1:])
    blocks = [kv[i].contiguous() for i in range(kv.shape[0])]
    views = [memoryview(b.reshape(-1).view(torch.uint8).numpy()) for b in blocks]
    raw = sum(v.nbytes for v in views)
    print(f"KV: {len(blocks)} blocks of {dtype}{list(shape)}, {raw / 1e6:.2f} MB, from a {args.tokens}-token prompt")
    print("NOTE: the small model has random weights; ratios on trained weights may differ.")
    print(f"{'codec':28s} {'ratio':>6s} {'enc MB/s':>9s} {'dec MB/s':>9s} {'break-even':>16s}  max|err|")
    outs = [memoryview(bytearray(v.nbytes)) for v in views]
    for codec in kc.CODECS:
        encs: list[kc.Encoded] = []
        enc_s = best_of(lambda: encs.__setitem__(slice(None), [kc.encode(v, dtype, shape, codec) for v in views]),
                        args.repeats)
        dec_s = best_of(lambda: [kc.decode(e.data, codec, dtype, shape, e.raw_nbytes, o) for e, o in zip(encs, outs)],
                        args.repeats)
        size = sum(e.nbytes for e in encs)
        err = max(float((torch.frombuffer(o, dtype=kv.dtype).reshape(shape).float() - b.float()).abs().max())
                  for o, b in zip(outs, blocks))
        be = (raw - size) / (enc_s + dec_s) if codec != "off" else 0.0
        print(f"{codec:28s} {raw / size:6.3f} {raw / enc_s / 1e6:9.0f} {raw / dec_s / 1e6:9.0f} "
              f"{be * 8 / 1e9:10.2f} Gbit/s  {err:.4g}")
    print("alternatives (encode only; break-even counts encode time twice as a stand-in for decode):")
    arrays = [np.frombuffer(v, dtype=np.uint8) for v in views]
    for name, (size_of, _) in alternatives().items():
        sizes: list[int] = []
        enc_s = best_of(lambda: sizes.__setitem__(slice(None), [size_of(a) for a in arrays]), args.repeats)
        size = sum(sizes)
        be = (raw - size) / (2 * enc_s)
        print(f"{name:28s} {raw / size:6.3f} {raw / enc_s / 1e6:9.0f} {'':>9s} {be * 8 / 1e9:10.2f} Gbit/s")
    costs = kc.measure_costs(views[len(views) // 2], dtype, shape)
    for gbps in (1, 10, 25):
        print(f"auto at {gbps:>2d} Gbit/s (one block measured): {kc.choose(gbps * 1e9 / 8, costs)}")


if __name__ == "__main__":
    main()
