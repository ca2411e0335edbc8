"""``pdserve profile``: measure what engine steps cost on this machine and fit a cost model.

The engine is the one a worker of ``pdserve up`` runs (same EngineConfig, one torch thread by
default), driven through ``LLMEngine.step`` so every sample includes scheduling, input
preparation, the forward pass and sampling. Each step's content comes from the scheduler's own
batch (its sequences' contexts and token counts); its wall time is the sample. The sweep:

* prefill: one prompt per chunk size, computed in chunks of that size (the token budget set to
  it), so each step is one chunk at a growing context; plus several prompts in one step;
* decode: for each context length and batch size, that many sequences sharing a prefix (the
  prefix cache makes setting them up cheap) decode a few steps;
* mixed: decoders running while a prompt is chunked in beside them.

Then the KV hand-off per block: copying a block out of the pool (what a prefill worker does
after each step), checksumming it and writing it into a pool (what a decode worker does). Last,
unless ``--no-serving``, the CPU the services spend around the engine, measured in a real
``pdserve up`` (``serving_costs.measure``).
"""
from __future__ import annotations

import os
import platform
import random
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.settings import pdserve_home, setting
from pdserve.engine.step_cost import StepSample, step_features
from pdserve.services.common.config_flags import config_to_argv
from pdserve.services.common.topology import ENGINE_FIXED, UP_PER_PROCESS, WORKER_THREADS, flags_argv
from pdserve.services.planner import serving_costs
from pdserve.services.planner.cost_model import CostModel
from pdserve.services.planner.serving_costs import ServingCosts




@dataclass(slots=True)
class ProfileConfig:
    """What `pdserve profile` sweeps (flags generated from these fields)."""

    out: str | None = setting(None, "where to write the profile JSON; none: $PDSERVE_HOME/profiles/MODEL.json")
    chunk_sizes: str = setting("32,128,512,1024", "prefill chunk sizes (tokens per step), comma-separated")
    max_context: int = setting(1024, "prefill: the longest prompt chunked at each chunk size")
    decode_batches: str = setting("1,2,4,8,16,24,32,48", "decode batch sizes (sequences per step), comma-separated: "
                             "the knots of the decode step's piecewise-linear cost in the batch size")
    decode_contexts: str = setting("64,512", "decode context lengths, comma-separated")
    decode_steps: int = setting(6, "decode steps measured per batch size and context")
    mixed_chunks: str = setting("64,256", "prefill chunk sizes measured beside running decodes")
    repeats: int = setting(2, "times the whole sweep runs (more samples, steadier fit)")
    kv_blocks: int = setting(16, "KV blocks copied to time the hand-off per block")
    serving: bool = setting(True, "also measure the CPU serving costs around the engine (event loops, router) in a real "
                             "`pdserve up`, colocated and 1P1D (about a minute)")
    clock: str = setting("cpu", "what a step costs: cpu (the engine thread's CPU time: what the step needs from a "
                           "core of its own, steady on a shared machine; for one torch thread) or wall",
                    choices=("cpu", "wall"))

    def __post_init__(self) -> None:
        for name in ("max_context", "decode_steps", "repeats", "kv_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("chunk_sizes", "decode_batches", "decode_contexts", "mixed_chunks"):
            _ints(name, getattr(self, name))

    def ints(self, name: str) -> list[int]:
        return _ints(name, getattr(self, name))


def _ints(name: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name} must list integers >= 1, got {text!r}")
    return values


class _Recorder:
    """Steps the engine and records every step as a sample."""

    def __init__(self, engine, clock: str = "cpu") -> None:
        self.engine = engine
        self.cpu_clock = clock == "cpu"
        self.samples: list[StepSample] = []
        self.seqs: dict[str, Any] = {}     # every sequence added, finished ones included
        self._rng = random.Random(0)
        self.vocab = engine.model_config.vocab_size

    def tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(2, self.vocab) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> None:
        rid = f"profile-{len(self.seqs)}"
        self.engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        self.seqs[rid] = self.engine.requests[rid]

    def step(self, record: bool = True) -> None:
        """One engine step; its batch is read back from the scheduler's trace, each sequence's
        context being its computed tokens before the step (after - n)."""
        engine = self.engine
        n_before = engine.num_steps
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if engine.num_steps == n_before or not record:
            return
        tr = engine.trace[-1]
        contexts = [max(0, self.seqs[rid].num_computed_tokens - n) for rid, n in zip(tr.request_ids, tr.num_tokens)]
        sample = step_features(contexts, tr.num_tokens, tr.num_decode_seqs, cpu if self.cpu_clock else dt)
        sample.wall_seconds = dt
        self.samples.append(sample)

    def run_until_idle(self, record: bool = True) -> None:
        while self.engine.has_unfinished_requests():
            self.step(record)

    def run_while_prefilling(self) -> None:
        sched = self.engine.scheduler
        while sched.waiting or any(s.is_prefilling for s in sched.running):
            self.step()


def run_profile(engine_config, config: ProfileConfig, say: Callable[[str], None] = print) -> CostModel:
    """Build the engine, run the sweep, fit. engine_config: an EngineConfig (role both)."""
    import dataclasses
    import json
    from pathlib import Path

    import torch

    from pdserve.engine import cpu_features   # lazy: torch only when a profile runs
    from pdserve.engine.llm_engine import LLMEngine   # lazy: torch only when this runs

    t_start = time.perf_counter()
    engine = LLMEngine(dataclasses.replace(engine_config, schedule_policy="mixed"))
    budget = engine.config.max_num_batched_tokens   # as the engine resolved it
    rec = _Recorder(engine, config.clock)
    say(f"profiling {engine_config.model}: backend {getattr(engine.runner.backend, 'name', 'torch')}, compute "
        f"{str(engine.runner.compute_dtype).removeprefix('torch.')}, {torch.get_num_threads()} thread(s), "
        f"{engine.block_manager.num_blocks} KV blocks")
    # warm-up: first steps pay for lazy initialisation
    rec.add(rec.tokens(64), 4)
    rec.run_until_idle(record=False)
    chunks = config.ints("chunk_sizes")
    batches = config.ints("decode_batches")
    max_seqs = engine_config.max_num_seqs
    for rep in range(config.repeats):
        # prefill: one long prompt chunked at each size
        for chunk in chunks:
            engine.config.max_num_batched_tokens = chunk
            rec.add(rec.tokens(max(chunk, config.max_context)), 1)
            rec.run_until_idle()
            # several prompts in one step
            k = 4 if chunk >= 16 else 1
            for _ in range(k):
                rec.add(rec.tokens(chunk // k), 1)
            rec.run_until_idle()
        engine.config.max_num_batched_tokens = budget
        say(f"  [{rep + 1}/{config.repeats}] prefill: {len(rec.samples)} steps ({time.perf_counter() - t_start:.0f}s)")
        # decode: batches sharing a prefix
        for ctx in config.ints("decode_contexts"):
            for b in batches:
                b = min(b, max_seqs)
                prefix = rec.tokens(max(0, ctx - 16))
                rec.add(prefix + rec.tokens(16), config.decode_steps + 4)   # computes the shared prefix once
                rec.run_while_prefilling()
                for _ in range(b - 1):
                    rec.add(prefix + rec.tokens(16), config.decode_steps + 4)
                rec.run_until_idle()
        say(f"  [{rep + 1}/{config.repeats}] decode: {len(rec.samples)} steps ({time.perf_counter() - t_start:.0f}s)")
        # mixed: a prompt chunked beside running decoders
        for chunk in config.ints("mixed_chunks"):
            for b in (min(4, max_seqs - 1), min(16, max_seqs - 1)):
                if b < 1:
                    continue
                prefix = rec.tokens(240)
                rec.add(prefix + rec.tokens(16), 12)
                rec.run_while_prefilling()
                for _ in range(b - 1):
                    rec.add(prefix + rec.tokens(16), 12)
                rec.run_while_prefilling()
                engine.config.max_num_batched_tokens = b + chunk
                rec.add(rec.tokens(2 * chunk), 1)
                rec.run_until_idle()
                engine.config.max_num_batched_tokens = budget
        say(f"  [{rep + 1}/{config.repeats}] mixed: {len(rec.samples)} steps ({time.perf_counter() - t_start:.0f}s)")
    export_s, transfer_s = _kv_block_costs(engine, config.kv_blocks,
                                          time.thread_time if config.clock == "cpu" else time.perf_counter)
    model_json = json.loads((Path(engine_config.model) / "config.json").read_text())
    serving = ServingCosts()
    if config.serving:
        up_args = [*config_to_argv(engine_config, exclude=(*ENGINE_FIXED, *UP_PER_PROCESS)),
                   *flags_argv(threads_per_worker=engine_config.num_threads or WORKER_THREADS)]
        log_dir = Path(config.out).parent if config.out else Path(pdserve_home()) / "profiles"
        serving = serving_costs.measure(engine_config.model, up_args, engine.runner.kv_bytes_per_block,
                                        engine.model_config.vocab_size, log_dir, say=say)
    engine_fields = {f.name: getattr(engine_config, f.name) for f in dataclasses.fields(engine_config)}
    engine_fields["resolved_compute_dtype"] = str(engine.runner.compute_dtype).removeprefix("torch.")
    engine_fields["resolved_num_kv_blocks"] = engine.block_manager.num_blocks
    engine_fields["backend"] = getattr(engine.runner.backend, "name", "torch")
    feats = cpu_features.detect()
    machine = {"cpu_model": feats.model, "machine": feats.machine, "amx_bf16": feats.amx_bf16,
               "avx512": feats.avx512, "avx512_bf16": feats.avx512_bf16, "cpu_count": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
               "loadavg_1m": os.getloadavg()[0], "clock": config.clock, "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "seconds": round(time.perf_counter() - t_start, 1)}
    return CostModel.fit(rec.samples, kv_transfer_s_per_block=transfer_s, export_s_per_block=export_s,
                         kv_bytes_per_block=engine.runner.kv_bytes_per_block, engine=engine_fields,
                         model_config=model_json, machine=machine, serving=serving)


def _kv_block_costs(engine, n: int, clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(export s/block, transfer s/block): copy blocks out of the pool as a prefill worker does
    after a step; then checksum and write each into the pool as a decode worker does, plus the
    bytes' serialisation (one more copy), which is what the hand-off costs on one host."""
    runner = engine.runner
    n = max(1, min(n, engine.block_manager.num_blocks))
    ids = list(range(n))
    runner.read_blocks(ids)   # warm
    reps = 5
    t0 = clock()
    for _ in range(reps):
        blocks = runner.read_blocks(ids)
    export = (clock() - t0) / (reps * n)
    t0 = clock()
    for _ in range(reps):
        for i in ids:
            payload = blocks[i].contiguous().view(-1).view(_u8()).numpy().tobytes()
            zlib.crc32(payload)
            runner.write_block(i, blocks[i])
    transfer = (clock() - t0) / (reps * n)
    return export, transfer


def _u8():
    import torch
    return torch.uint8
