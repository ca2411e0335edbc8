#!/usr/bin/env python
"""The planner in the loop against static layouts, following a load step, in one run (issue 20).

Every setup is a `pdserve up` of ``--workers`` workers on this machine (the small model, one torch
thread each, loopback; on a 2-core machine the 3 workers, the router, the load generator and the
planner share 2 cores, and `up` does not pin the workers) serving the same schedule: phases of
``--phase-s`` seconds, each with its own Poisson rate and random prompt and output lengths
(``--rates``, ``--input-lens``, ``--output-lens``: one value per phase, or one for all), greedy
with ignore_eos, the same prompts and arrivals in every setup. Defaults: 1 -> 4 -> 1 req/s, the
high phase prefill-heavy (256 in / 32 out, 128 / 128 around it), 90 s each.

* ``static-XPYD``: every prefill:decode split of the workers, held fixed (1P2D and 2P1D for 3);
* ``planner``:     starts at the worst static split (``--planner-start`` to choose), with
  ``pdserve plan --watch --apply`` running alongside: every ``--interval-s`` it reads the router's
  /metrics, simulates every split on the profile's cost model and switches worker roles through
  the membership API (docs/planner.md).

Best and worst are the static splits with the highest and lowest SLO attainment over the whole
schedule, as measured in this run. Per setup it records every request (arrival, TTFT, TPOT,
success), SLO attainment (TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``; a failure
misses; by arrival phase) and goodput (requests within both per second of the phase) per phase
and overall, the members' roles and states polled every second, and the planner's lines and
decisions with their times. The table goes to stdout; the figures (per phase and overall, the
rolling attainment, the P:D changes, the planner's decisions) to ``planner_loop.json`` and a plot
(offered rate and the planner's P:D over time above, rolling SLO attainment per setup below) to
``planner_loop.png``, in ``--out`` (default docs/images); every request and membership poll to
``planner_loop_requests.json`` beside the logs. The planner's cost model is
``--profile``, else measured first with ``pdserve profile`` (about 2 min). With the defaults the
run takes about 17 minutes (3 setups of about 5 minutes, and the profile; more while ``--max-load``
waits for the machine to quiet down)::

    PYTHONPATH=. python bench/planner_loop.py --max-load 1.5
    PYTHONPATH=. python bench/planner_loop.py --profile small.json --rates 1,3,1 --input-lens 256 --phase-s 60

The logs (each deployment's, the planner's, the profile's) go to ``--result-dir`` (default a new
/tmp/pdserve-planner-loop-<time>). Every process started is stopped at the end, on an error, on
Ctrl-C and on SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from bench.vs_vllm_commands import git_info, machine_info  # noqa: E402

SPLIT = re.compile(r"^(\d+)P(\d+)D$")
ROUTER_METRICS = re.compile(r"^\s+router\s+\S+\s+metrics http://(\S+)/metrics", re.M)


@dataclass(frozen=True, slots=True)
class Phase:
    """One stretch of the schedule: Poisson arrivals at rate, random prompts of fixed lengths."""

    rate: float
    input_len: int
    output_len: int
    seconds: float

    @property
    def label(self) -> str:
        return f"{self.rate:g} req/s, {self.input_len}/{self.output_len}"


@dataclass(frozen=True, slots=True)
class Arrival:
    offset_s: float
    phase: int
    request: Any            # services.loadtest.datasets.SampleRequest


def phases_from(args: argparse.Namespace) -> list[Phase]:
    """--rates, --input-lens, --output-lens as phases (a single value applies to every phase)."""
    lists = [[float(x) for x in args.rates.split(",")], [int(x) for x in args.input_lens.split(",")],
             [int(x) for x in args.output_lens.split(",")]]
    n = max(len(v) for v in lists)
    if any(len(v) not in (1, n) for v in lists):
        raise SystemExit("--rates, --input-lens and --output-lens take one value, or one per phase")
    rates, ins, outs = (v * n if len(v) == 1 else v for v in lists)
    if min(rates) <= 0 or min(ins) < 1 or min(outs) < 2 or args.phase_s <= 0:
        raise SystemExit("rates and --phase-s must be > 0, input lengths >= 1, output lengths >= 2")
    return [Phase(r, i, o, args.phase_s) for r, i, o in zip(rates, ins, outs)]


def schedule(phases: list[Phase], vocab: int, seed: int) -> list[Arrival]:
    """Each phase's Poisson arrivals within its span, its own prompts; deterministic for a seed."""
    import numpy as np

    from pdserve.services.loadtest.datasets import DatasetOptions, sample_requests
    rng = np.random.default_rng(seed)
    out, start = [], 0.0
    for i, ph in enumerate(phases):
        offsets, t = [], start + rng.exponential(1 / ph.rate)
        while t < start + ph.seconds:
            offsets.append(t)
            t += rng.exponential(1 / ph.rate)
        if offsets:
            reqs = sample_requests(DatasetOptions("random", input_len=ph.input_len, output_len=ph.output_len),
                                   len(offsets), vocab, seed=seed + 1 + i)
            out += [Arrival(t, i, r) for t, r in zip(offsets, reqs)]
        start += ph.seconds
    return out


def split_of(name: str) -> tuple[int, int]:
    m = SPLIT.match(name)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise SystemExit(f"a split is like 1P2D, got {name!r}")
    return int(m[1]), int(m[2])


# ---- the deployment, the planner and the members' roles -----------------------------------------
class Members(threading.Thread):
    """Polls the router's membership every period_s: (time, [(role, state)] per member)."""

    def __init__(self, router: str, token: str, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        from pdserve.services.common.security import Credentials
        self.router, self.creds, self.period_s = router, Credentials(token), period_s
        self.samples: list[tuple[float, list[tuple[str, str]]]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        from pdserve.v1 import membership_pb2 as m
        from pdserve.v1 import membership_pb2_grpc, worker_pb2
        with self.creds.sync_channel(self.router) as channel:
            stub = membership_pb2_grpc.MembershipStub(channel)
            while not self.stopping.is_set():
                try:
                    listed = stub.ListWorkers(m.ListWorkersRequest(), timeout=5).workers
                    self.samples.append((time.perf_counter(), [
                        (worker_pb2.WorkerRole.Name(w.role).removeprefix("WORKER_ROLE_").lower(),
                         m.MemberState.Name(w.state).removeprefix("MEMBER_STATE_").lower()) for w in listed]))
                except Exception as exc:  # noqa: BLE001 - a missed poll is a gap, not a failure
                    self.samples.append((time.perf_counter(), [("error", str(exc)[:80])]))
                self.stopping.wait(self.period_s)

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)


class PlannerProcess:
    """`pdserve plan --watch --apply` in its own session; its lines kept with their times."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self.log = open(log_path, "w")
        self.popen = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append((time.perf_counter(), line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def started(self, timeout: float) -> None:
        """Wait for its first line (it prints it before its first read of /metrics)."""
        deadline = time.monotonic() + timeout
        while not self.lines:
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the planner did not start: see {self.log.name}")
            time.sleep(0.1)

    def stop(self) -> None:
        drivers.stop_up(self.popen, timeout=10)
        self.reader.join(5)
        self.log.close()


def start_deployment(name: str, split: tuple[int, int], args: argparse.Namespace, model: str, logs: Path,
                     env: dict[str, str]) -> tuple[subprocess.Popen, str, str]:
    """`pdserve up` of split, with /metrics; (process, router address, router metrics address)."""
    from pdserve.services.deployment.launcher import free_port, wait_serving
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--http-port", "none", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", "1", "--prefill-workers", str(split[0]), "--decode-workers", str(split[1]),
           "--disaggregation", "always", "--metrics",
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--log-dir", str(logs / name)]
    log_path = logs / f"{name}-up.log"
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    with open(log_path, "w") as log:   # as drivers.start_up, with the cluster token in env
        popen = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        deadline = time.monotonic() + 30
        while not (found := ROUTER_METRICS.search(log_path.read_text())):
            if time.monotonic() > deadline or popen.poll() is not None:
                raise RuntimeError(f"[{name}] no router metrics address in {log_path}")
            time.sleep(0.2)
    except BaseException:
        drivers.stop_up(popen)
        raise
    return popen, f"127.0.0.1:{port}", found[1]


async def serve(address: str, arrivals: list[Arrival], tag: str, one_by_one: bool = False) -> tuple[list, float]:
    """The schedule (one_by_one: each request after the last, no schedule); (results in order, start time)."""
    from pdserve.services.loadtest.grpc_backend import GrpcBackend
    from pdserve.services.loadtest.results import Sampling
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    async with GrpcBackend(address, 600.0) as client:
        start = time.perf_counter()
        if one_by_one:
            return [await client.send(a.request, f"{tag}-{i}", sampling, start) for i, a in enumerate(arrivals)], start

        async def one(i: int, a: Arrival):
            await asyncio.sleep(max(0.0, start + a.offset_s - time.perf_counter()))
            return await client.send(a.request, f"{tag}-{i}", sampling, start)

        results = await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
    return list(results), start


def run_setup(name: str, split: tuple[int, int], planner: bool, args: argparse.Namespace, ctx: dict) -> dict:
    """One deployment serving the schedule (with the planner alongside when planner is set)."""
    from pdserve.services.common.security import new_token
    drivers.wait_for_quiet(args.max_load, args.max_wait_s)
    load_before = os.getloadavg()[0]
    token = new_token()
    # the planner changes membership: it proves the router's admin token, which `up` takes from here
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PDSERVE_CLUSTER_TOKEN": token,
           "PDSERVE_ADMIN_TOKEN": new_token()}
    popen, router, metrics = start_deployment(name, split, args, ctx["model"], ctx["logs"], env)
    members, plan = Members(router, token), None
    try:
        asyncio.run(serve(router, ctx["warmup"], f"{name}-warm", one_by_one=True))
        members.start()
        if planner:
            plan = PlannerProcess(planner_cmd(args, ctx["profile"], router, metrics), env,
                                  ctx["logs"] / f"{name}-plan.log")
            plan.started(timeout=60)
        results, start = asyncio.run(serve(router, ctx["arrivals"], name))
        end = time.perf_counter()
    finally:
        if plan is not None:
            plan.stop()
        members.stop()
        drivers.stop_up(popen)
    requests = [{"phase": a.phase, "arrival_s": a.offset_s, "start_s": r.start_time, "success": r.success,
                 "ttft_ms": r.ttft * 1e3 if r.success else None,
                 "tpot_ms": r.tpot * 1e3 if r.success and r.tpot is not None else None,
                 "output_len": r.output_len, "error": r.error[:120]}
                for a, r in zip(ctx["arrivals"], results)]
    for q in requests:
        q["good"] = good(q, args)
    timeline = [{"t_s": t - start, "members": ms} for t, ms in members.samples]
    lines = [] if plan is None else [{"t_s": t - start, "line": line} for t, line in plan.lines]
    decisions = [{"t_s": x["t_s"], **json.loads(x["line"].removeprefix("decision "))}
                 for x in lines if x["line"].startswith("decision ")]
    out = {"setup": name, "start_split": f"{split[0]}P{split[1]}D", "planner": planner, "load_before": load_before,
           "duration_s": end - start, "requests": requests, "timeline": timeline, "planner_lines": lines,
           "decisions": decisions, **summary(requests, ctx["phases"])}
    print(f"[{name}] attainment {out['attainment']:.0%}, goodput {out['goodput']:.2f} req/s, "
          f"failed {out['failed']}", flush=True)
    return out


def planner_cmd(args: argparse.Namespace, profile: str, router: str, metrics: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.services.cli", "plan", "--watch", "--apply", "--profile", profile,
            "--router", router, "--router-metrics", metrics, "--slo", f"ttft:{args.slo_ttft_ms:g}",
            "--slo", f"tpot:{args.slo_tpot_ms:g}", "--interval-s", str(args.interval_s),
            "--confirmations", str(args.confirmations), "--min-dwell-s", str(args.min_dwell_s),
            "--min-window-requests", str(args.min_window_requests), "--hysteresis", str(args.hysteresis),
            "--num-prompts", str(args.plan_num_prompts), "--chunk-budgets", str(args.max_num_batched_tokens),
            "--threads-per-worker", "1", "--cores", str(os.cpu_count() or 1)]   # every worker on this machine


def measure_profile(model: str, logs: Path) -> str:
    """`pdserve profile` of the model at one thread (its own `pdserve up` inside: SIGINT stops it)."""
    out = logs / "profile.json"
    cmd = [sys.executable, "-m", "pdserve.services.cli", "profile", "--model", model, "--threads", "1", "--out", str(out)]
    popen = drivers.start_up(cmd, logs / "profile.log", "[profile]")
    try:
        if popen.wait() != 0:
            raise RuntimeError(f"pdserve profile failed: see {logs / 'profile.log'}")
    finally:
        if popen.poll() is None:   # SIGINT: its `finally` stops the `pdserve up` it started (SIGTERM would not)
            popen.send_signal(signal.SIGINT)
            try:
                popen.wait(45)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
    return str(out)


# ---- figures ----------------------------------------------------------------------------------
def good(q: dict, args: argparse.Namespace) -> bool:
    return bool(q["success"] and q["ttft_ms"] <= args.slo_ttft_ms
                and (q["tpot_ms"] is None or q["tpot_ms"] <= args.slo_tpot_ms))


def summary(requests: list[dict], phases: list[Phase]) -> dict:
    """SLO attainment and goodput (good requests per second of the phase) per phase and overall."""
    import numpy as np

    def part(qs: list[dict], seconds: float) -> dict:
        done = [q["ttft_ms"] for q in qs if q["success"]]
        tpots = [q["tpot_ms"] for q in qs if q["tpot_ms"] is not None]
        n_good = sum(q["good"] for q in qs)
        return {"num_requests": len(qs), "good": n_good, "failed": sum(not q["success"] for q in qs),
                "attainment": n_good / len(qs) if qs else float("nan"), "goodput": n_good / seconds,
                "ttft_p99_ms": float(np.percentile(done, 99)) if done else None,
                "tpot_p99_ms": float(np.percentile(tpots, 99)) if tpots else None}

    per_phase = [part([q for q in requests if q["phase"] == i], ph.seconds) for i, ph in enumerate(phases)]
    return {**part(requests, sum(ph.seconds for ph in phases)), "phases": per_phase}


def splits_over_time(timeline: list[dict]) -> list[tuple[float, int, int, int]]:
    """(t, prefill serving, decode serving, others: switching, draining...) at each change, and last."""
    out: list[tuple[float, int, int, int]] = []
    for s in timeline:
        ms = s["members"]
        p = sum(r == "prefill" and st == "serving" for r, st in ms)
        d = sum(r == "decode" and st == "serving" for r, st in ms)
        if not out or out[-1][1:] != (p, d, len(ms) - p - d) or s is timeline[-1]:
            out.append((round(s["t_s"], 1), p, d, len(ms) - p - d))
    return out


def rolling(requests: list[dict], window_s: float, total_s: float) -> list[tuple[float, float | None]]:
    """(t, SLO attainment of the requests that arrived in the window_s before t) every window_s / 4."""
    import numpy as np
    out = []
    for t in np.arange(window_s, total_s + 1e-9, max(1.0, window_s / 4)):
        win = [q["good"] for q in requests if t - window_s <= q["arrival_s"] < t]
        out.append((round(float(t), 1), round(sum(win) / len(win), 3) if win else None))
    return out


def switches(setup: dict) -> list[str]:
    """The planner's applied changes and role switches, with their times."""
    out = [f"{d['t_s']:.0f}s: {d['current']} -> {d['best']}" for d in setup["decisions"] if d["applied"]]
    out += [f"{x['t_s']:.0f}s: {x['line']}" for x in setup["planner_lines"] if x["line"].startswith("switched")]
    return out


def table(setups: list[dict], phases: list[Phase]) -> str:
    head = " | ".join(f"phase {i + 1}: {ph.label}" for i, ph in enumerate(phases))
    lines = [f"| setup | start | {head} | overall | goodput (req/s) | failed | TTFT p99 (ms) | TPOT p99 (ms) |",
             "|---|---|" + "---:|" * len(phases) + "---:|---:|---:|---:|---:|"]
    for s in setups:
        cells = " | ".join(f"{p['attainment']:.0%}" for p in s["phases"])
        lines.append(f"| {s['label']} | {s['start_split']} | {cells} | **{s['attainment']:.0%}** | "
                     f"{s['goodput']:.2f} | {s['failed']} | {s['ttft_p99_ms'] or 0:.0f} | "
                     f"{s['tpot_p99_ms'] or 0:.1f} |")
    return "\n".join(lines)


def plot(setups: list[dict], phases: list[Phase], workers: int, path: Path, args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    total = sum(ph.seconds for ph in phases)
    edges = np.cumsum([0.0] + [ph.seconds for ph in phases])
    fig, (top, low) = plt.subplots(2, 1, figsize=(8, 6.4), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
    top.step(edges, [ph.rate for ph in phases] + [phases[-1].rate], where="post", color="black", label="offered rate")
    top.set_ylabel("offered rate (req/s)")
    top.set_ylim(0, max(ph.rate for ph in phases) * 1.25)
    right = top.twinx()
    for s in setups:
        pts = splits_over_time(s["timeline"]) if s["planner"] else []
        if pts:   # prefill workers serving, half a step for each worker on its way between roles
            right.step([max(0.0, p[0]) for p in pts], [p[1] + 0.5 * p[3] for p in pts], where="post",
                       color="tab:red", label=f"{s['label']}: its split (between: a worker switching)")
    right.set_yticks(range(1, workers), [f"{p}P{workers - p}D" for p in range(1, workers)])
    right.set_ylim(0.5, workers - 0.5)
    right.set_ylabel("the planner's split")
    handles = top.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    right.legend(handles=handles, loc="upper left", fontsize=8)
    top.set_title(f"pdserve planner in the loop: {workers} workers, 1 thread each, {os.cpu_count()} cores")
    for s in setups:
        pts = rolling(s["requests"], args.rolling_s, total)
        low.plot([t for t, _ in pts], [np.nan if a is None else a for _, a in pts],
                 label=f"{s['label']} (overall {s['attainment']:.0%})", linewidth=2 if s["planner"] else 1.2)
    for ax in (top, low):
        for e in edges[1:-1]:
            ax.axvline(e, color="grey", linestyle=":")
    low.set_ylim(-0.05, 1.05)
    low.set_ylabel(f"SLO attainment, last {args.rolling_s:g}s of arrivals")
    low.set_xlabel(f"time (s); SLOs TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    low.legend(loc="lower left", fontsize=8)
    low.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the run ----------------------------------------------------------------------------------
def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the small model, made once)")
    p.add_argument("--profile", default=None, help="the planner's cost model (default: `pdserve profile` first)")
    p.add_argument("--workers", type=int, default=3, help="workers of every setup (their splits are the statics)")
    p.add_argument("--setups", default="static,planner", help="static, planner or both")
    p.add_argument("--planner-start", default=None, help="the planner's first split (default: the worst static)")
    p.add_argument("--rates", default="1,4,1", help="req/s per phase")
    p.add_argument("--input-lens", default="128,256,128", help="prompt tokens per phase (or one for all)")
    p.add_argument("--output-lens", default="128,32,128", help="output tokens per phase (or one for all)")
    p.add_argument("--phase-s", type=float, default=90.0, help="seconds per phase")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the workers' step budget (and the "
                                                                            "planner's simulated one)")
    drivers.add_flags(p, interval_s=10.0, confirmations=2, min_dwell_s=30.0, min_window_requests=5,
                      hysteresis=0.1, plan_num_prompts=60)
    p.add_argument("--rolling-s", type=float, default=20.0, help="the plot's attainment window")
    p.add_argument("--num-warmups", type=int, default=2, help="requests of each phase's shape before the load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-load", type=float, default=None, help="wait for the 1-min load average to drop below "
                                                                "this before each setup")
    p.add_argument("--max-wait-s", type=float, default=300.0)
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "images"), help="the JSON and the plot")
    p.add_argument("--result-dir", default=None, help="logs (default: a new /tmp/pdserve-planner-loop-<time>)")
    return p.parse_args()


def main() -> int:
    args = arguments()
    signal.signal(signal.SIGTERM, signal.default_int_handler)   # stop as on Ctrl-C: every child is stopped
    phases = phases_from(args)
    kinds = drivers.names(args.setups, ("static", "planner"), "setup kind")
    statics = [(p, args.workers - p) for p in range(1, args.workers)]
    if args.workers < 2 or ("planner" in kinds and args.workers < 3):
        raise SystemExit("--workers: at least 2 (3 for the planner: two splits to choose from)")
    if "static" not in kinds and not args.planner_start:
        raise SystemExit("the planner alone needs --planner-start (the worst static split is not measured)")
    model = drivers.model_dir(args.model)
    logs = drivers.result_dir(args.result_dir, "planner-loop")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from pdserve.engine.model_config import ModelConfig
    vocab = ModelConfig.from_dir(model).vocab_size
    arrivals = schedule(phases, vocab, args.seed)
    from pdserve.services.loadtest.datasets import DatasetOptions, sample_requests
    warmup = [Arrival(0.0, i, r) for i, ph in enumerate(phases) for r in sample_requests(
        DatasetOptions("random", input_len=ph.input_len, output_len=ph.output_len), args.num_warmups, vocab,
        seed=10_000 + i)] if args.num_warmups > 0 else []
    print(f"{len(arrivals)} requests over {len(phases)} phases: " + "; ".join(
        f"{ph.label} for {ph.seconds:g}s ({sum(a.phase == i for a in arrivals)} requests)"
        for i, ph in enumerate(phases)) + f"; logs in {logs}", flush=True)
    ctx = {"model": model, "logs": logs, "phases": phases, "arrivals": arrivals, "warmup": warmup, "profile": None}
    setups: list[dict] = []
    if "static" in kinds:
        for split in statics:
            setups.append(run_setup(f"static-{split[0]}P{split[1]}D", split, False, args, ctx))
        ranked = sorted(setups, key=lambda s: (s["attainment"], s["goodput"]))
        ranked[0]["label"] = f"{ranked[0]['setup']} (worst static)"
        ranked[-1]["label"] = f"{ranked[-1]['setup']} (best static)"
        for s in ranked[1:-1]:
            s["label"] = s["setup"]
    if "planner" in kinds:
        ctx["profile"] = args.profile or measure_profile(model, logs)
        start = split_of(args.planner_start) if args.planner_start else split_of(ranked[0]["start_split"])
        if sum(start) != args.workers:
            raise SystemExit(f"--planner-start {args.planner_start} is not a split of {args.workers} workers")
        run = run_setup("planner", start, True, args, ctx)
        run["label"] = f"planner (from {run['start_split']})"
        setups.append(run)
    print(table(setups, phases))
    for s in setups:
        if s["planner"]:
            print(f"{s['label']}: {len(s['decisions'])} decisions; changes: " + ("; ".join(switches(s)) or "none"))
    meta = {"args": vars(args), "phases": [asdict(ph) for ph in phases], "model": model, "profile": ctx["profile"],
            "cpu": machine_info()["cpu_model"], "cores": os.cpu_count(), "commit": git_info().get("short", ""), "logs": str(logs)}
    (logs / "planner_loop_requests.json").write_text(json.dumps({**meta, "setups": setups}))   # everything
    total = sum(ph.seconds for ph in phases)
    brief = [{**{k: v for k, v in s.items() if k not in ("requests", "timeline", "planner_lines")},
              "splits": splits_over_time(s["timeline"]),
              "rolling_attainment": rolling(s["requests"], args.rolling_s, total)} for s in setups]
    (out / "planner_loop.json").write_text(json.dumps({**meta, "setups": brief}, indent=1))
    plot(setups, phases, args.workers, out / "planner_loop.png", args)
    print(f"wrote {out / 'planner_loop.json'}, {out / 'planner_loop.png'} and {logs / 'planner_loop_requests.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
