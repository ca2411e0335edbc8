"""Applying a grammar's token bitmask to logits on the CPU, every way bench/grammar_backends.py
compares: a [B, ceil(V/32)] int32 bitmask (xgrammar's layout: bit k of word w allows token 32w+k)
applied in place to float32 logits [B, V] (disallowed -> -inf).

The variants: xgrammar's ``apply_token_bitmask_inplace`` (its CPU kernel, and its torch_native
backend), llguidance's (a ``torch.compile``d unpack; its compile shows in "first call"), pdserve's own
(``pdserve.engine.structured.bitmask.apply``, as ``engine/layers/sampler.py`` calls it: each byte of
the mask indexes a 256 x 8 table of -0.0 / -inf, added to the logits), and the other plain-torch
unpacks (the straightforward int32 shift, and byte-wise lookup tables). Each call gets a
fresh copy of the same logits (the copy is not timed) and each result is checked to equal xgrammar's
bit for bit.

Run alone, it times them on random bitmasks (``--allowed``: the fraction of tokens allowed); the
grammar benchmark uses the masks of its real JSON-schema walks instead.

    python bench/bitmask_apply.py --vocab-size 151936 --batches 1,32 --repeats 20
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.grammar_results import Results, apply_table, ms, summarize, timed  # noqa: E402

PDSERVE_VARIANT = "pdserve (byte table of -0/-inf, add_)"


def torch_apply_variants() -> dict[str, Callable[[Any, Any], None]]:
    """Plain-torch ways to apply an int32 bitmask [B, W] (bit k of word w = token 32w+k, 1 = allowed) to
    float32 logits [B, V] in place (disallowed -> -inf). Viewing the bitmask as bytes keeps that
    order on a little-endian CPU: bit b of byte i is token 8i+b, so a 256-entry table per byte
    expands 8 tokens at once."""
    import torch
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()          # [256, 8]
    # one int64 per byte value whose 8 bytes are the 8 "disallowed" bools: gather, then view as bool
    off64 = ((~bits).to(torch.int64) << (8 * torch.arange(8))).sum(-1)                 # [256]
    # 8 float32 penalties per byte value: -0.0 where allowed (x + -0.0 == x bit for bit, also for
    # x = +-0.0), -inf where not (x + -inf == -inf for every finite x; +inf or NaN logits give NaN)
    penalty = torch.where(bits, torch.tensor(-0.0), torch.tensor(float("-inf")))     # [256, 8]
    neg_inf = torch.tensor(float("-inf"))

    def int32_shift(logits: Any, bitmask: Any) -> None:       # the straightforward unpack
        b, v = logits.shape
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(b, -1)[:, :v]
        logits.masked_fill_(allowed == 0, float("-inf"))

    def byte_index(bitmask: Any) -> Any:
        return bitmask.view(torch.uint8).reshape(-1).to(torch.int32)

    def lut_masked_fill(logits: Any, bitmask: Any) -> None:   # bool mask by table, then masked_fill_
        b, v = logits.shape
        off = off64.index_select(0, byte_index(bitmask)).view(torch.bool).view(b, -1)[:, :v]
        logits.masked_fill_(off, float("-inf"))

    def lut_where(logits: Any, bitmask: Any) -> None:         # same bool mask, torch.where(out=logits)
        b, v = logits.shape
        off = off64.index_select(0, byte_index(bitmask)).view(torch.bool).view(b, -1)[:, :v]
        torch.where(off, neg_inf, logits, out=logits)

    def lut_add(logits: Any, bitmask: Any) -> None:           # float penalty by table, then add_
        b, v = logits.shape
        logits.add_(penalty.index_select(0, byte_index(bitmask)).view(b, -1)[:, :v])

    return {"torch int32 shift + masked_fill_": int32_shift, "torch byte-LUT bool + masked_fill_": lut_masked_fill,
            "torch byte-LUT bool + where(out=)": lut_where, "torch byte-LUT -0/-inf + add_": lut_add}



def apply_variants(model_vocab: int, want_compile: bool) -> dict[str, Callable[[Any, Any], None]]:
    """name -> fn(logits, bitmask) applying in place, the libraries' first (xgrammar's CPU kernel is
    the reference the others are checked against)."""
    import xgrammar as xgr

    from pdserve.engine.structured import bitmask   # the sampler's apply

    variants: dict[str, Callable[[Any, Any], None]] = {
        "xgrammar apply (auto=cpu kernel)": lambda l, m: xgr.apply_token_bitmask_inplace(
            l, m, vocab_size=model_vocab),
        "xgrammar apply torch_native": lambda l, m: xgr.apply_token_bitmask_inplace(
            l, m, vocab_size=model_vocab, backend="torch_native"),
    }
    if want_compile:
        import llguidance.torch as llt
        variants["llguidance apply (torch.compile)"] = llt.apply_token_bitmask_inplace
    variants[PDSERVE_VARIANT] = lambda l, m: bitmask.apply(l, m)
    variants.update(torch_apply_variants())
    return variants


def bench_apply(vocab_key: str, model_vocab: int, mask_rows: list[bytes], batches: list[int], repeats: int,
                res: Results, want_compile: bool) -> None:
    """For each batch size B: B rows of ``mask_rows`` (cycled) applied by every variant to the same
    seeded random logits; a row per variant in ``res.apply`` (a variant that fails is a row too)."""
    import numpy as np
    import torch
    import xgrammar as xgr
    width = (model_vocab + 31) // 32
    rows = [np.frombuffer(r, dtype=np.int32) for r in mask_rows]
    variants = apply_variants(model_vocab, want_compile)
    for batch in batches:
        bitmask = torch.from_numpy(np.stack([rows[i % len(rows)] for i in range(batch)]).copy())
        assert bitmask.shape == (batch, width)
        gen = torch.Generator().manual_seed(0)
        base = torch.randn((batch, model_vocab), generator=gen, dtype=torch.float32)
        reference = base.clone()
        xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=model_vocab)
        work = base.clone()
        for name, fn in variants.items():
            first_ns = None
            try:
                work.copy_(base)
                first_ns, _ = timed(lambda: fn(work, bitmask))    # includes a torch.compile, if any
                same = bool(torch.equal(work.view(torch.int32), reference.view(torch.int32)))
                times = []
                for _ in range(repeats):
                    work.copy_(base)                              # a fresh copy each call, not timed
                    dt, _ = timed(lambda: fn(work, bitmask))
                    times.append(dt)
                same = same and bool(torch.equal(work.view(torch.int32), reference.view(torch.int32)))
                row = {"variant": name, "vocab": vocab_key, "batch": batch, "first_call_ms": ms(first_ns),
                       "identical_to_xgrammar": same, **summarize(times)}
            except Exception as e:  # noqa: BLE001 - a variant that cannot run here is reported
                row = {"variant": name, "vocab": vocab_key, "batch": batch, "error": f"{type(e).__name__}: "
                       f"{str(e).splitlines()[0][:160] if str(e) else ''}"}
            res.apply.append(row)
            if row.get("identical_to_xgrammar") is False:
                res.problems.append(f"apply {name} {vocab_key} B={batch}: differs from xgrammar's result")


def random_mask_rows(model_vocab: int, n: int, allowed: float, seed: int = 0) -> list[bytes]:
    """``n`` bitmask rows (bytes of int32 words) allowing each token with probability ``allowed``."""
    import numpy as np
    rng = np.random.default_rng(seed)
    width = (model_vocab + 31) // 32
    out = []
    for _ in range(n):
        bits = np.zeros(width * 32, dtype=bool)
        bits[:model_vocab] = rng.random(model_vocab) < allowed
        out.append(np.packbits(bits, bitorder="little").tobytes())   # little-endian int32 words
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab-size", type=int, default=151_936, help="logits width (default: Qwen3's 151,936)")
    p.add_argument("--batches", default="1,32", help="batch sizes (default 1,32)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per variant and batch size (default 20)")
    p.add_argument("--allowed", type=float, default=0.05, help="fraction of tokens each row allows (default 0.05)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (and OMP_NUM_THREADS; default 1)")
    p.add_argument("--no-torch-compile", action="store_true",
                   help="skip llguidance's apply (it torch.compiles, ~10+ s the first time)")
    args = p.parse_args(argv)
    os.environ.update({"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)})
    import torch
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    res = Results()
    rows = random_mask_rows(args.vocab_size, max(batches), args.allowed)
    bench_apply(f"random V={args.vocab_size}", args.vocab_size, rows, batches, max(1, args.repeats), res,
                not args.no_torch_compile)
    print(apply_table(res.apply))
    for problem in res.problems:
        print(f"- {problem}")


if __name__ == "__main__":
    main()
