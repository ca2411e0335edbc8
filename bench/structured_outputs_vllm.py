"""The vLLM side of bench/structured_outputs.py, run with vLLM's python (standard library + vllm only).

Reads a job (--job FILE, JSON: model, dtype, schemas (JSON texts), warmup and prompts (each
{"ids": token ids, "schema": index into schemas}), max_tokens, compact, out: a file path),
builds vLLM's offline LLM (compact: the xgrammar backend with disable_any_whitespace, else vLLM's
default structured-outputs config, what an OpenAI response_format request gets), generates the
warm-up prompts (which compiles every schema's grammar), then times one generate call of all the
prompts, greedy, each under StructuredOutputsParams(json=its schema) (constrained false: none, and
ignore_eos, every request max_tokens long). Writes JSON there: vLLM's
version, the timed call's wall seconds and, per prompt, the output token ids and finish reason."""
from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True, help="the job's JSON file (written by bench/structured_outputs.py)")
    with open(p.parse_args().job) as f:
        job = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    config = {"backend": "xgrammar", "disable_any_whitespace": True} if job["compact"] else {}
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=2048, seed=0,
              structured_outputs_config=config)

    def run(prompts: list[dict]) -> tuple[float, list]:
        params = [SamplingParams(temperature=0.0, max_tokens=job["max_tokens"],
                                 structured_outputs=StructuredOutputsParams(json=job["schemas"][p["schema"]]))
                  if job.get("constrained", True) else
                  SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
                  for p in prompts]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p["ids"]} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    warmup_s, _ = run(job["warmup"])
    wall_s, outs = run(job["prompts"])
    results = [{"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason}
               for o in outs]
    with open(job["out"], "w") as f:
        json.dump({"vllm": vllm.__version__, "config": config or "default", "warmup_s": warmup_s,
                   "wall_s": wall_s, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
