#!/usr/bin/env python
"""How many of the first N greedy tokens the engine shares with Hugging Face transformers.

Runs the engine with its defaults (compute dtype chosen from the CPU) and, for comparison, with
``compute_dtype="float32"``, on a few random prompts of the ``small`` model, and HF ``generate``
(greedy) in float32 and in bf16. Prints, per engine mode and HF dtype, the length of the common
prefix of each prompt's continuation. Reported, not asserted: bf16 math may diverge from
float32 after a near-tie. Example::

    PYTHONPATH=. python bench/greedy_agreement.py --prompts 6 --tokens 64
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pdserve.services.loadtest.offline import hf_greedy  # noqa: E402


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.model_maker import ensure_model
    torch.set_num_threads(args.threads)
    model_dir = str(ensure_model("small"))
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 8192) for _ in range(rng.randint(16, 200))] for _ in range(args.prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    refs = {"hf-float32": hf_greedy(model_dir, prompts, args.tokens, torch.float32),
            "hf-bfloat16": hf_greedy(model_dir, prompts, args.tokens, torch.bfloat16)}
    base = [common_prefix(a, b) for a, b in zip(refs["hf-bfloat16"], refs["hf-float32"])]
    print(f"hf-bfloat16 vs hf-float32: common prefix per prompt {base} of {args.tokens}")
    for mode in ("auto", "float32"):
        llm = LLM(model_dir, compute_dtype=mode, num_threads=args.threads, device="cpu")
        outs = [o.token_ids for o in llm.generate(prompts, greedy)]
        label = f"engine compute {mode} ({str(llm.engine.runner.compute_dtype).removeprefix('torch.')}, " \
                f"{llm.engine.runner.backend.name})"
        for ref_name, ref in refs.items():
            agree = [common_prefix(o, r) for o, r in zip(outs, ref)]
            print(f"{label} vs {ref_name}: common prefix per prompt {agree} of {args.tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
