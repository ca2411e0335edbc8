"""Numerical fidelity per serving path: how close pdserve's token log-probabilities are to HF
transformers float32 on a real model (default: SmolLM2-135M-Instruct) and real text (Genesis, KJV).

pdserve reports logprobs of the tokens it generates (SamplingParams.logprobs; the router's
GenerateResponse.logprobs), not of the prompt. So: N windows of the text (each W tokens, evenly
spaced) are prompts, sent as token ids (tokenization is no variable); each path generates M
tokens greedily (temperature 0, ignore_eos) with the chosen token's logprob, one request at a time.
HF transformers (float32, the checkpoint's bf16 weights upcast) is then run teacher-forced on
exactly prompt + the tokens that path generated. Per path, over all its generated tokens:

* mean and max |Δ log-prob|: the path's logprob of each token against HF float32's;
* greedy agreement: the share of generated tokens equal to HF float32's argmax on the same prefix;
* perplexity of the continuation under the path, exp(-mean logprob), next to HF's on the same
  tokens, and their relative difference.

Paths (each a real deployment started here, `pdserve up` or `pdserve ray up --address local`, and
stopped after; served paths are queried through the gRPC client `pdserve.Client`): llm (the
in-process LLM), colocated (one colocated worker), tcp / grpc / shm (disaggregated 1 prefill +
1 decode, the KV hand-off over the raw TCP data plane, the gRPC stream, or /dev/shm segments),
ray (Ray actors, KV through the object store), lossless / int8 (TCP with that KV wire codec),
tp2 / tp3 (tensor parallel 2 or 3 on both roles: SmolLM2-135M's 9 attention heads take 3, not 2),
w8a16 (int8 weights), bf16 (bf16 weights, KV and compute).
Every path but bf16 runs --dtype float32 --compute-dtype float32. Streamed-KV paths other than
shm turn shared memory off; paths with no codec named send it raw (--kv-compression off).

    python bench/fidelity.py                                   # every path, 8 x 512 tokens, 32 new
    python bench/fidelity.py --windows 2 --max-tokens 8 --paths llm,tcp

Prints a markdown table, the command, the commit, the CPU and the wall time; the deployments'
logs go to a folder under /tmp (named at the start).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402

TEXT = REPO_ROOT / "engine" / "data" / "genesis_kjv.txt"
FP32 = ["--dtype", "float32", "--compute-dtype", "float32"]
BF16 = ["--dtype", "bfloat16", "--compute-dtype", "bfloat16"]
COLOCATED = ["--prefill-workers", "0", "--decode-workers", "0", "--colocated-workers", "1"]
RAW_TCP = ["--kv-data-plane", "tcp", "--no-kv-shared-memory"]


@dataclass(frozen=True)
class PathSpec:
    kind: str            # "llm" (in-process), "up" (`pdserve up`) or "ray" (`pdserve ray up --address local`)
    flags: list[str]     # the launcher's flags (llm: EngineConfig kwargs from them)
    what: str


PATHS: dict[str, PathSpec] = {
    "llm": PathSpec("llm", FP32, "in-process LLM, colocated engine"),
    "colocated": PathSpec("up", [*COLOCATED, *FP32], "pdserve up, 1 colocated worker"),
    "tcp": PathSpec("up", [*RAW_TCP, "--kv-compression", "off", *FP32], "1P+1D, KV over raw TCP"),
    "grpc": PathSpec("up", ["--kv-data-plane", "grpc", "--no-kv-shared-memory", "--kv-compression", "off", *FP32],
                     "1P+1D, KV over the gRPC stream"),
    "shm": PathSpec("up", ["--kv-data-plane", "grpc", "--kv-shared-memory", "--kv-compression", "off", *FP32],
                    "1P+1D, KV through /dev/shm"),
    "ray": PathSpec("ray", ["--kv-transport", "ray", "--kv-compression", "off", *FP32],
                    "Ray actors, KV through the object store"),
    "lossless": PathSpec("up", [*RAW_TCP, "--kv-compression", "lossless", *FP32], "1P+1D, TCP, lossless KV codec"),
    "int8": PathSpec("up", [*RAW_TCP, "--kv-compression", "int8", *FP32], "1P+1D, TCP, int8 KV codec"),
    "tp2": PathSpec("up", ["--tensor-parallel-size", "2", *FP32], "1P+1D, tensor parallel 2 each"),
    "tp3": PathSpec("up", ["--tensor-parallel-size", "3", *FP32], "1P+1D, tensor parallel 3 each"),
    "w8a16": PathSpec("up", ["--quantization", "w8a16", *FP32], "1P+1D, int8 weights"),
    "bf16": PathSpec("up", BF16, "1P+1D, bf16 weights, KV and compute"),
}


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    kv: str = ""          # the router's account of the KV hand-off (route, codec, bytes)


@dataclass
class PathResult:
    name: str
    gens: list[Generation] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


# ---- text and reference -------------------------------------------------------------------------

def windows(model: str, n: int, width: int) -> list[list[int]]:
    """n windows of width tokens of the text, evenly spaced (disjoint when the text is long enough)."""
    from pdserve.engine.tokenizer import load_tokenizer
    ids = load_tokenizer(model).encode(TEXT.read_text())
    if len(ids) < width:
        raise SystemExit(f"{TEXT.name} has {len(ids)} tokens, fewer than --window-tokens {width}")
    step = (len(ids) - width) // max(n - 1, 1)
    return [ids[i * step:i * step + width] for i in range(n)]


class Reference:
    """HF transformers float32, teacher-forced; cached per token sequence (paths often agree)."""

    def __init__(self, model: str, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.cache: dict[tuple[int, ...], tuple[list[float], list[int]]] = {}

    def score(self, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[int]]:
        """(HF's logprob of each generated token, HF's argmax at each of those positions)."""
        key = (*prompt, *tokens)
        if key not in self.cache:
            torch = self.torch
            ids = torch.tensor([[*prompt, *tokens[:-1]]])
            with torch.inference_mode():
                logits = self.model(ids).logits[0, len(prompt) - 1:].float()
            lp = torch.log_softmax(logits, dim=-1)
            chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)]
            self.cache[key] = (chosen.tolist(), lp.argmax(dim=-1).tolist())
        return self.cache[key]


# ---- the paths ----------------------------------------------------------------------------------

def run_llm(model: str, flags: list[str], prompts: list[list[int]], max_tokens: int, threads: int) -> list[Generation]:
    from pdserve import LLM, SamplingParams
    kwargs = {flags[i].lstrip("-").replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    with LLM(model, num_threads=threads, **kwargs) as llm:
        outs = [llm.generate([p], params)[0] for p in prompts]
    return [Generation(p, list(o.token_ids), [lp.logprob for lp in o.logprobs], "colocated")
            for p, o in zip(prompts, outs)]


def run_client(address: str, prompts: list[list[int]], max_tokens: int) -> list[Generation]:
    """Each prompt through the router's Generate (gRPC client), token ids in, logprobs asked."""
    from pdserve import Client
    from pdserve.services.client import Completion, build_request
    out = []
    with Client(address, timeout=600) as client:
        for prompt in prompts:
            req = build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            req.params.logprobs = 0
            comp, logprobs = Completion(""), []
            for msg in client.stub.Generate(req, timeout=600, metadata=client.metadata, wait_for_ready=True):
                comp.add(msg)
                logprobs += [lp.logprob for lp in msg.logprobs]
            if len(logprobs) != len(comp.token_ids) or len(comp.token_ids) != max_tokens:
                raise RuntimeError(f"{len(comp.token_ids)} tokens and {len(logprobs)} logprobs for max_tokens "
                                   f"{max_tokens} (finish_reason {comp.finish_reason})")
            t = comp.timings
            kv = (f"{t['prefill_route']}, {t['kv_codec'] or '-'}, {t['kv_bytes'] / 2**20:.1f}->"
                  f"{t['kv_wire_bytes'] / 2**20:.1f} MiB" if t.get("kv_bytes") else str(t.get("prefill_route") or ""))
            out.append(Generation(prompt, comp.token_ids, logprobs, kv))
    return out


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextlib.contextmanager
def up_deployment(name: str, model: str, flags: list[str], threads: int, logs: Path) -> Iterator[str]:
    """`pdserve up` with flags on a free port; its router's address; stopped (router and workers) after."""
    from pdserve.services.deployment.launcher import free_port, wait_serving
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--http-port", "none", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--threads", str(threads), "--drain-timeout-s", "5", "--no-restart",
           "--log-dir", str(logs / name), "--disaggregation", "always", *flags]   # 1P+1D: every KV over the path
    popen = drivers.start_up(cmd, logs / f"{name}-up.log", f"[{name}]")
    try:
        try:
            wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        except Exception as exc:   # the launcher's own error line first, when it wrote one
            tail = _tail(logs / f"{name}-up.log")
            errors = [line for line in tail.splitlines() if "error:" in line]
            raise RuntimeError(f"{errors[-1] if errors else exc}\n{tail}") from None
        yield f"127.0.0.1:{port}"
    finally:
        drivers.stop_up(popen)


@contextlib.contextmanager
def ray_deployment(name: str, model: str, flags: list[str], threads: int, logs: Path) -> Iterator[str]:
    """`pdserve ray up --address local` in a private $PDSERVE_HOME (its own local head, no one
    else's); `ray down` after, and the head's process group killed if it outlives that."""
    from pdserve.engine.settings import pdserve_home
    from pdserve.services.deployment.launcher import free_port
    home = Path(tempfile.mkdtemp(prefix="pdserve-fidelity-ray-"))
    if (pdserve_home() / "kernels").is_dir():   # built native kernels, not rebuilt
        (home / "kernels").symlink_to(pdserve_home() / "kernels")
    env = {**os.environ, "PDSERVE_HOME": str(home),
           "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = [sys.executable, "-m", "pdserve.services.cli", "ray"]
    common = ["--address", "local", "--name", f"fidelity{os.getpid()}"]
    cmd = [*base, "up", *common, "--model", model, "--host", "127.0.0.1", "--port", str(free_port()),
           "--num-threads", str(threads), "--drain-timeout-s", "5", "--json", *flags]
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    log = logs / f"{name}-ray.log"
    try:
        with open(log, "w") as err:
            up = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                timeout=400, start_new_session=True)
        if up.returncode != 0:
            raise RuntimeError(f"ray up exited with code {up.returncode}\n{_tail(log)}")
        yield json.loads(up.stdout.strip().splitlines()[-1])["router_address"]
    finally:
        with open(log, "a") as err:
            subprocess.run([*base, "down", *common], cwd=REPO_ROOT, env=env, stdout=err, stderr=err, timeout=120)
        state = home / "ray" / "local-cluster.json"
        if state.exists():   # `ray down` stops it; a head left by a failed down is killed here
            with contextlib.suppress(ProcessLookupError, ValueError, KeyError, PermissionError):
                os.killpg(int(json.loads(state.read_text())["pgid"]), signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)


def run_path(name: str, model: str, prompts: list[list[int]], args: argparse.Namespace, logs: Path) -> PathResult:
    spec, res, t0 = PATHS[name], PathResult(name), time.monotonic()
    try:
        if spec.kind == "llm":
            res.gens = run_llm(model, spec.flags, prompts, args.max_tokens, args.threads)
        else:
            deploy = up_deployment if spec.kind == "up" else ray_deployment
            with deploy(name, model, spec.flags, args.threads, logs) as address:
                res.gens = run_client(address, prompts, args.max_tokens)
    except Exception as exc:   # reported in the table, not hidden
        res.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    res.seconds = time.monotonic() - t0
    outcome = "FAILED: " + res.error.splitlines()[0] if res.error else "done"
    print(f"[{name}] {outcome} ({res.seconds:.0f}s)", flush=True)
    return res


# ---- the report ---------------------------------------------------------------------------------

def measure(res: PathResult, ref: Reference) -> dict[str, float]:
    deltas, agree, path_lp, hf_lp = [], 0, [], []
    for g in res.gens:
        hf, argmax = ref.score(g.prompt, g.tokens)
        deltas += [abs(a - b) for a, b in zip(g.logprobs, hf)]
        agree += sum(t == a for t, a in zip(g.tokens, argmax))
        path_lp += g.logprobs
        hf_lp += hf
    ppl, ppl_hf = math.exp(-sum(path_lp) / len(path_lp)), math.exp(-sum(hf_lp) / len(hf_lp))
    return {"mean": sum(deltas) / len(deltas), "max": max(deltas), "agree": agree / len(deltas), "n": len(deltas),
            "ppl": ppl, "ppl_hf": ppl_hf, "ppl_rel": (ppl / ppl_hf - 1) * 100}


def table(results: list[PathResult], ref: Reference) -> str:
    lines = ["| path | setup | mean \\|Δ\\| | max \\|Δ\\| | greedy agreement | perplexity path / HF (Δ%) "
             "| KV hand-off (first request) |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        label = f"{r.name} | {PATHS[r.name].what}"
        if r.error:
            lines.append(f"| {label} | FAILED: {r.error.splitlines()[0][:200]} | | | | |")
            continue
        m = measure(r, ref)
        lines.append(f"| {label} | {m['mean']:.2e} | {m['max']:.2e} | {m['agree']:.1%} ({round(m['agree'] * m['n'])}/"
                     f"{m['n']}) | {m['ppl']:.4f} / {m['ppl_hf']:.4f} ({m['ppl_rel']:+.4f}%) | {r.gens[0].kv} |")
    return "\n".join(lines)


def commit() -> str:
    """HEAD's commit, read from .git (no git command)."""
    git = REPO_ROOT / ".git"
    head = (git / "HEAD").read_text().strip()
    if not head.startswith("ref: "):
        return head
    ref = head[5:]
    if (git / ref).exists():
        return f"{(git / ref).read_text().strip()} ({ref})"
    packed = git / "packed-refs"
    for line in packed.read_text().splitlines() if packed.exists() else ():
        if line.endswith(" " + ref):
            return f"{line.split()[0]} ({ref})"
    return f"unknown ({ref})"


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), "unknown")
    return f"{name}, {os.cpu_count()} CPUs"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: pdserve's default model)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)} (default: all)")
    p.add_argument("--windows", type=int, default=8, help="prompts: windows of the text")
    p.add_argument("--window-tokens", type=int, default=512, help="tokens of each prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated greedily per prompt")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each worker (and of the in-process LLM)")
    p.add_argument("--hf-threads", type=int, default=os.cpu_count() or 1, help="torch threads of the HF reference")
    args = p.parse_args(argv)
    paths = drivers.names(args.paths, PATHS, "path")
    t0 = time.monotonic()
    from pdserve.engine.checkpoints.resolve import resolve_model
    model = str(resolve_model(args.model))
    logs = drivers.result_dir(None, "fidelity")
    print(f"model {model}; logs in {logs}", flush=True)
    prompts = windows(model, args.windows, args.window_tokens)
    results = [run_path(name, model, prompts, args, logs) for name in paths]
    ref = Reference(model, args.hf_threads)
    report = table(results, ref)
    print()
    print(f"Token log-probs against HF transformers float32 (teacher-forced on each path's own tokens): "
          f"{args.windows} windows x {args.window_tokens} tokens of {TEXT.name}, {args.max_tokens} tokens "
          f"generated greedily each. Every path computes in float32 (--dtype float32 --compute-dtype float32) "
          f"except bf16 (bf16 weights, KV and compute).\n")
    print(report)
    print()
    shown = [sys.executable, *sys.argv] if argv is None else ["bench/fidelity.py", *argv]
    print(f"command: {shlex.join(shown)}")
    print(f"model: {model}")
    print(f"commit: {commit()}")
    print(f"cpu: {cpu_model()}")
    print(f"wall time: {time.monotonic() - t0:.0f}s ({', '.join(f'{r.name} {r.seconds:.0f}s' for r in results)})")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
