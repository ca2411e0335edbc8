"""``pdserve plan``: which deployment serves a workload best per core, under latency SLOs.

For every candidate within the core budget (colocated x K; xPyD), chunk budget
(max_num_batched_tokens) and schedule policy, the simulator (services/planner/simulator.py: the real
scheduler and block manager, step times from the profile's cost model) serves the same
workload ``pdserve bench serve`` would send: services/loadtest's random dataset and Poisson
arrivals, for the same seed, or a slice of a production trace (``--dataset-name mooncake_trace``
or ``azure_trace``: its arrival times and lengths, the same blocks for the same hash ids, scaled
as bench serve scales it). The metrics are the load generator's own (``calculate_metrics``).
The recommendation maximises goodput (requests meeting every SLO per second) per core (the
cheapest deployment for the load), or with ``--objective goodput`` the goodput itself within the
core budget (the best use of this machine; ties to fewer cores); ties go to the lower TTFT p99.

    pdserve plan --profile P.json --rate 2 --input-len 256 --output-len 128 --slo ttft:500 --slo tpot:50
    pdserve plan --profile P.json --dataset-name mooncake_trace --dataset-path conversation_trace.jsonl \
        --num-prompts 240 --trace-token-scale 0.03125 --trace-output-scale 0.25 --rate 1 \
        --slo ttft:2000 --slo tpot:100
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from pdserve.engine.settings import setting
from pdserve.services.loadtest.arrivals import arrival_offsets
from pdserve.services.loadtest.datasets import DatasetOptions, sample_requests
from pdserve.services.loadtest.metrics import calculate_metrics, parse_slo
from pdserve.services.loadtest.traces import MOONCAKE_BLOCK, TRACES, TraceOptions, load_trace
from pdserve.services.planner.cost_model import CostModel
from pdserve.services.planner.simulator import Candidate, Overheads, Simulation

PERCENTILES = (50, 90, 99)
DEFAULT_RATE = 2.0   # req/s of the random dataset when --rate is not given
OBJECTIVES = ("goodput_per_core", "goodput")


@dataclass(slots=True)
class Workload:
    """bench serve's random dataset under Poisson (gamma) arrivals (PlanConfig holds the CLI's defaults)."""

    rate: float
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    burstiness: float = 1.0
    seed: int = 0

    def requests(self, vocab_size: int, eos_token_id: int | None) -> tuple[list[list[int]], list[int], list[float]]:
        reqs = sample_requests(DatasetOptions("random", input_len=self.input_len, output_len=self.output_len,
                                              range_ratio=self.range_ratio), self.num_prompts, vocab_size,
                               seed=self.seed, eos_token_id=eos_token_id)
        offsets = arrival_offsets(self.num_prompts, self.rate, self.burstiness, self.seed)
        return [r.prompt for r in reqs], [r.expected_output_len for r in reqs], offsets  # type: ignore[misc]

    def describe(self) -> str:
        return (f"{self.num_prompts} requests of {self.input_len} in / {self.output_len} out tokens at "
                f"{self.rate:g} req/s (seed {self.seed})")


@dataclass(slots=True)
class TraceReplay:
    """A slice of a production trace, as bench serve replays it (services/loadtest/traces.py)."""

    options: TraceOptions
    num_prompts: int
    seed: int = 0
    _loaded: dict = field(default_factory=dict, repr=False)   # (vocab, eos) -> requests: read once per plan

    def requests(self, vocab_size: int, eos_token_id: int | None) -> tuple[list[list[int]], list[int], list[float]]:
        key = (vocab_size, eos_token_id)
        if key not in self._loaded:
            trace = load_trace(self.options, self.num_prompts, vocab_size, seed=self.seed, eos_token_id=eos_token_id)
            self._loaded[key] = ([r.prompt for r in trace.requests],
                                 [r.expected_output_len for r in trace.requests], trace.offsets)
        return self._loaded[key]   # the simulation copies what it keeps

    def describe(self) -> str:
        o = self.options
        timing = f"rescaled to {o.rate:g} req/s" if o.rate is not None else f"its times x {o.time_scale:g}"
        return (f"{self.num_prompts} rows of {o.name} {os.path.basename(o.path)} from row {o.start} (inputs x "
                f"{o.token_scale:g}, outputs x {o.output_scale:g}, {timing}; seed {self.seed})")


@dataclass(slots=True)
class PlanConfig:
    """`pdserve plan` settings (flags generated from these fields; --slo is added by the CLI)."""

    profile: str | None = setting(None, "the cost model `pdserve profile` wrote (required)")
    rate: float | None = setting(None, "requests per second: the random dataset's Poisson arrivals (default 2), or "
                                       "a trace's slice rescaled to this mean rate (default: the trace's own times x "
                                       "--trace-time-scale); as `bench serve --request-rate`")
    dataset_name: str = setting("random", "the workload: bench serve's random dataset, or a production trace "
                                          "replayed (as `bench serve --dataset-name`)", choices=("random", *TRACES))
    dataset_path: str | None = setting(None, "the trace file (a trace's --dataset-name)")
    trace_start: int = setting(0, "traces: rows skipped before the slice")
    trace_token_scale: float = setting(1.0, "traces: input lengths (and a block's tokens) x this")
    trace_output_scale: float = setting(1.0, "traces: output lengths x this")
    trace_time_scale: float = setting(1.0, "traces: gaps between arrivals x this, unless --rate is given")
    trace_block_size: int = setting(MOONCAKE_BLOCK, "mooncake_trace: tokens per hash id before scaling")
    num_prompts: int = setting(200, "requests simulated (as `bench serve --num-prompts`)")
    input_len: int = setting(256, "prompt tokens (as `bench serve --random-input-len`)")
    output_len: int = setting(128, "output tokens (as `bench serve --random-output-len`, with --ignore-eos)")
    range_ratio: float = setting(0.0, "length spread (as `bench serve --random-range-ratio`)")
    burstiness: float = setting(1.0, "gamma shape of the arrival gaps; 1: Poisson")
    seed: int = setting(0, "workload seed (as `bench serve --seed`)")
    cores: int | None = setting(None, "core budget: the candidates fit in it; with --watch, the cores the running "
                                      "workers share (more workers than cores take turns); none: this machine's "
                                      "cores, and with --watch a core per worker")
    chunk_budgets: str = setting("256,512,2048", "max_num_batched_tokens candidates, comma-separated")
    policies: str = setting("mixed,prefill_first,interleave", "schedule policy candidates of colocated workers")
    disaggregations: str = setting("always,conditional", "the router's --disaggregation candidates of xPyD "
                                                         "deployments")
    threads_per_worker: int = setting(1, "torch threads per worker (the profile's cost model is for its own count)")
    router_overhead_ms: float = setting(2.0, "client -> router -> worker, per request (on TTFT)")
    token_overhead_ms: float = setting(0.5, "a token's way back to the client")
    handoff_overhead_ms: float = setting(2.0, "disaggregated: first token -> the decode worker's Decode call")
    kv_ms_per_block: float | None = setting(None, "KV transfer time per block; none: the profile's")
    objective: str = setting("goodput_per_core", "what the recommendation maximises: goodput per core (the cheapest "
                                                 "deployment for the load) or goodput (the best use of the core "
                                                 "budget; ties to fewer cores)", choices=OBJECTIVES)
    out: str | None = setting(None, "also write every candidate's metrics to this JSON file")
    slos: tuple[str, ...] = field(default=(), metadata={"cli": False})

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.dataset_name in TRACES:
            if not self.dataset_path:
                raise ValueError(f"--dataset-name {self.dataset_name} needs --dataset-path")
            self.trace_options.validate()
        for name in ("num_prompts", "input_len", "output_len", "threads_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        parse_slos(self.slos)

    @property
    def trace_options(self) -> TraceOptions:
        return TraceOptions(str(self.dataset_path), self.dataset_name, self.trace_start, self.trace_token_scale,
                            self.trace_output_scale, self.trace_time_scale, self.trace_block_size, self.rate)

    @property
    def workload(self) -> "Workload | TraceReplay":
        if self.dataset_name in TRACES:
            return TraceReplay(self.trace_options, self.num_prompts, self.seed)
        return Workload(DEFAULT_RATE if self.rate is None else self.rate, self.num_prompts, self.input_len,
                        self.output_len, self.range_ratio, self.burstiness, self.seed)

    @property
    def overheads(self) -> Overheads:
        return Overheads(self.router_overhead_ms / 1e3, self.token_overhead_ms / 1e3, self.handoff_overhead_ms / 1e3,
                         None if self.kv_ms_per_block is None else self.kv_ms_per_block / 1e3)


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] or ["ttft:500,tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds,
    bench serve's --goodput keys; each limit > 0)."""
    return dict(parse_slo(part, "--slo", allow_zero=False) for item in items for part in str(item).split(",")
                if part.strip())


def candidates(cores: int, chunk_budgets: Sequence[int], policies: Sequence[str], threads: int = 1,
               disaggregations: Sequence[str] = ("always",)) -> list[Candidate]:
    """Every colocated x K and xPyD deployment that fits in cores, for each budget (and policy, or
    disaggregation mode)."""
    slots = cores // threads
    out: list[Candidate] = []
    for budget in chunk_budgets:
        for k in range(1, slots + 1):
            for policy in policies:
                out.append(Candidate(colocated_workers=k, max_num_batched_tokens=budget, schedule_policy=policy,
                                     threads_per_worker=threads))
        for p in range(1, slots):
            for d in range(1, slots - p + 1):
                for mode in disaggregations:
                    out.append(Candidate(prefill_workers=p, decode_workers=d, max_num_batched_tokens=budget,
                                         threads_per_worker=threads, disaggregation=mode))
    return out


def simulate(cost: CostModel, candidate: Candidate, workload: "Workload | TraceReplay",
             overheads: Overheads | None = None, slos: dict[str, float] | None = None) -> dict[str, Any]:
    """bench serve's metrics of candidate under workload, predicted; plus the simulation itself."""
    mc = cost.model_config
    eos = mc.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    prompts, outs, offsets = workload.requests(int(mc["vocab_size"]), eos)
    sim = Simulation(cost, candidate, overheads)
    results = sim.run(prompts, outs, offsets)
    done = [r for r in results if r.success]
    duration = max((r.start_time + r.latency for r in done), default=0.0) - min((r.start_time for r in results),
                                                                                default=0.0)
    metrics = calculate_metrics(results, max(duration, 1e-9), PERCENTILES, slos or None)
    metrics["slo_attainment"] = (metrics["request_goodput"] * duration / len(results)) if slos else None
    metrics["cores"] = candidate.cores
    metrics["goodput_per_core"] = (metrics["request_goodput"] or 0.0) / candidate.cores if slos else None
    metrics["local_prefills"] = sim.local_routes   # conditional disaggregation: prompts kept on their decode worker
    metrics["simulation"] = sim
    return metrics


def rank(rows: list[tuple[Candidate, dict[str, Any]]], objective: str = "goodput_per_core"
         ) -> list[tuple[Candidate, dict[str, Any]]]:
    """Best first: goodput per core (throughput per core without SLOs), then TTFT p99; or goodput
    (throughput), then fewer cores, then TTFT p99."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")

    def key(row: tuple[Candidate, dict[str, Any]]) -> tuple[float, ...]:
        _, m = row
        served = (m["request_goodput"] or 0.0) if m["goodput_per_core"] is not None else m["request_throughput"]
        if objective == "goodput":
            return (-round(served, 6), m["cores"], m["p99_ttft_ms"])
        return (-round(served / m["cores"], 6), m["p99_ttft_ms"])
    return sorted(rows, key=key)


def table(rows: Sequence[tuple[Candidate, dict[str, Any]]], slos: dict[str, float]) -> str:
    head = ("| candidate | cores | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 / p99 (ms) | req/s |"
            + (" SLO met | goodput/core |" if slos else ""))
    lines = [head, "|" + "---|" * (6 + (2 if slos else 0))]
    for c, m in rows:
        line = (f"| {c.name} | {c.cores} | {m['p50_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f} | "
                f"{m['p50_itl_ms']:.1f} / {m['p99_itl_ms']:.1f} | {m['p50_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} | "
                f"{m['request_throughput']:.2f} |")
        if slos:
            line += f" {m['slo_attainment']:.0%} | {m['goodput_per_core']:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def run_plan(config: PlanConfig, out=None) -> int:
    out = out or sys.stdout
    if not config.profile:
        raise ValueError("--profile is required: make one with `pdserve profile --model DIR`")
    cost = CostModel.load(config.profile)
    slos = parse_slos(config.slos)
    cores = config.cores or os.cpu_count() or 1
    budgets = [int(b) for b in config.chunk_budgets.split(",") if b.strip()]
    policies = [p.strip() for p in config.policies.split(",") if p.strip()]
    profiled_threads = cost.machine.get("torch_threads")
    if profiled_threads and profiled_threads != config.threads_per_worker:
        print(f"warning: the profile was measured with {profiled_threads} thread(s), the candidates use "
              f"{config.threads_per_worker}", file=sys.stderr)
    modes = [m.strip() for m in config.disaggregations.split(",") if m.strip()]
    cands = candidates(cores, budgets, policies, config.threads_per_worker, modes)
    if not cands:
        raise ValueError(f"no deployment fits in {cores} core(s) at {config.threads_per_worker} thread(s) per worker")
    w = config.workload
    print(f"pdserve plan: {len(cands)} candidates within {cores} core(s); {w.describe()}; SLOs "
          f"{', '.join(f'{k} <= {v:g} ms' for k, v in slos.items()) or 'none'}", file=out, flush=True)
    t0 = time.perf_counter()
    rows = [(c, simulate(cost, c, w, config.overheads, slos)) for c in cands]
    ranked = rank(rows, config.objective)
    print(table(ranked, slos), file=out)
    best, m = ranked[0]
    print(f"\nrecommended: {best.name} ({best.cores} core(s)): TTFT p50/p99 {m['p50_ttft_ms']:.0f}/{m['p99_ttft_ms']:.0f} ms,"
          f" ITL p50/p99 {m['p50_itl_ms']:.1f}/{m['p99_itl_ms']:.1f} ms, TPOT p50/p99 {m['p50_tpot_ms']:.1f}/"
          f"{m['p99_tpot_ms']:.1f} ms" + (f", {m['slo_attainment']:.0%} of requests within the SLOs, goodput "
                                          f"{m['request_goodput']:.2f} req/s" if slos else ""), file=out)
    print(f"deploy: pdserve up --model {cost.engine.get('model', 'MODEL')} {best.up_flags()}", file=out)
    print(f"({len(cands)} simulations in {time.perf_counter() - t0:.1f}s)", file=out)
    if config.out:
        rows_json = [{"candidate": c.name, "up_flags": c.up_flags(),
                      **{k: v for k, v in m.items() if not isinstance(v, (list, Simulation))}} for c, m in ranked]
        with open(config.out, "w") as f:
            json.dump({"workload": w.describe(), "slos": slos,
                       "cores": cores, "candidates": rows_json}, f, indent=1)
    return 0

