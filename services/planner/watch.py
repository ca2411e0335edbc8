"""`pdserve plan --watch`: the planner in the loop.

Every ``interval_s`` it reads the router's live ``/metrics`` (finished requests, prompt and
output tokens, TTFT and TPOT histograms) for the window since the last read, and the router's
members (the Membership API). It simulates every prefill:decode split of the same workers
(services/planner/plan.simulate: the real scheduler, the profile's step costs) on the traffic
it measured — Poisson arrivals at the window's rate, its mean prompt and output lengths — and
compares the best split's predicted goodput under the SLOs with the current split's.

A change is made (``--apply``) only when the best split beats the current one by more than
``hysteresis`` (a fraction of the current goodput) in ``confirmations`` windows in a row, and
``min_dwell_s`` after the last change: a noisy window does not flip roles back and forth. The
change is one role switch per worker moved, through ``Membership.SwitchRole`` (the worker is
drained, switched in its process, and takes requests again in its new role: no request lost).
Every window's decision is printed, with both splits' predicted figures.
"""
from __future__ import annotations

import json
import math
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from engine.settings import setting
from services.planner.cost_model import CostModel
from services.planner.plan import PlanConfig, Workload, parse_slos, simulate
from services.planner.simulator import Candidate

ROUTER_METRICS = ("request_success_total", "request_failure_total", "prompt_tokens_total", "generation_tokens_total",
                  "num_requests_running")   # the last a gauge: requests in flight through the router
HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "tpot": "time_per_output_token_seconds"}


@dataclass(slots=True)
class WatchConfig:
    """`pdserve plan --watch` settings (besides PlanConfig's: the profile, SLOs, the simulated
    prompt count and the chunk budget)."""

    watch: bool = setting(False, "re-plan the running deployment from the router's live /metrics every "
                                 "--interval-s (needs --router, --router-metrics and at least one --slo)")
    router: str = setting("", "watch: the router's gRPC address (its membership API; the cluster token)",
                          metavar="HOST:PORT")
    router_metrics: str = setting("", "watch: the router's /metrics address", metavar="HOST:PORT")
    interval_s: float = setting(15.0, "watch: seconds per window of traffic")
    min_window_requests: int = setting(10, "watch: a window with fewer finished requests is not planned on")
    hysteresis: float = setting(0.1, "watch: a split must beat the current one's predicted goodput by this "
                                     "fraction of it")
    confirmations: int = setting(2, "watch: windows in a row that must call for the same change")
    min_dwell_s: float = setting(60.0, "watch: no change sooner than this after the last")
    apply: bool = setting(False, "watch: make the change (role switches through the router's membership API); "
                                 "without it the planner only says what it would do")
    max_windows: int = setting(0, "watch: stop after this many windows (0: until interrupted)")

    def __post_init__(self) -> None:
        if self.watch and not (self.router and self.router_metrics):
            raise ValueError("--watch needs --router HOST:PORT and --router-metrics HOST:PORT")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        for name in ("min_window_requests", "confirmations", "max_windows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.hysteresis < 0 or self.min_dwell_s < 0:
            raise ValueError("hysteresis and min_dwell_s must be >= 0")


# ---- what the router's metrics say ------------------------------------------------------------
@dataclass(slots=True)
class Scrape:
    """One read of the router's /metrics: counters summed over labels, histogram buckets by le."""

    at: float
    counters: dict[str, float]
    buckets: dict[str, dict[float, float]]   # histogram name -> upper bound -> cumulative count

    @classmethod
    def parse(cls, text: str, at: float) -> "Scrape":
        counters: dict[str, float] = {}
        buckets: dict[str, dict[float, float]] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            name = name.removeprefix("pdserve:")
            if name.endswith("_bucket"):
                le = next((part.split("=", 1)[1].strip('"') for part in labels.rstrip("}").split(",")
                           if part.startswith("le=")), None)
                if le is not None:
                    hist = buckets.setdefault(name.removesuffix("_bucket"), {})
                    bound = math.inf if le == "+Inf" else float(le)
                    hist[bound] = hist.get(bound, 0.0) + float(value)
                continue
            counters[name] = counters.get(name, 0.0) + float(value)
        return cls(at, counters, buckets)


@dataclass(slots=True)
class Traffic:
    """The requests between two scrapes: those that finished (their lengths), and those that
    arrived (finished, failed, and the change in the requests in flight): a deployment that
    cannot keep up finishes fewer than arrive, and the planner must plan for what arrives."""

    seconds: float
    requests: float
    failures: float
    prompt_tokens: float
    output_tokens: float
    within: dict[str, float] = field(default_factory=dict)   # "ttft"/"tpot" -> fraction within its SLO
    backlog: float = 0.0      # the change in requests in flight through the router

    @classmethod
    def between(cls, old: Scrape, new: Scrape, slos: dict[str, float]) -> "Traffic":
        d = {k: new.counters.get(k, 0.0) - old.counters.get(k, 0.0) for k in ROUTER_METRICS}
        within = {}
        for key, hist in HISTOGRAMS.items():
            if key in slos:
                within[key] = _fraction_within(old.buckets.get(hist, {}), new.buckets.get(hist, {}), slos[key] / 1e3)
        return cls(new.at - old.at, d["request_success_total"], d["request_failure_total"], d["prompt_tokens_total"],
                   d["generation_tokens_total"], within, d["num_requests_running"])

    @property
    def rate(self) -> float:
        """Arrivals per second."""
        arrived = max(0.0, self.requests + self.failures + self.backlog)
        return arrived / self.seconds if self.seconds > 0 else 0.0

    def workload(self, num_prompts: int, seed: int) -> Workload:
        """The window as the planner's workload: Poisson arrivals at its rate, its mean lengths."""
        n = max(self.requests, 1.0)
        return Workload(max(self.rate, 1e-3), num_prompts, max(1, round(self.prompt_tokens / n)),
                        max(1, round(self.output_tokens / n)), seed=seed)

    def describe(self) -> str:
        n = max(self.requests, 1.0)
        seen = ", ".join(f"{k} within SLO {v:.0%}" for k, v in self.within.items() if not math.isnan(v))
        return (f"{self.rate:.2f} req/s arriving ({self.requests / max(self.seconds, 1e-9):.2f} finishing) over "
                f"{self.seconds:.0f}s, {self.prompt_tokens / n:.0f} in / "
                f"{self.output_tokens / n:.0f} out tokens" + (f", {seen}" if seen else "")
                + (f", {self.failures:.0f} failed" if self.failures else ""))


def _fraction_within(old: dict[float, float], new: dict[float, float], limit_s: float) -> float:
    """Of the window's observations, the fraction in buckets bounded at or below limit_s (NaN: none)."""
    total = new.get(math.inf, 0.0) - old.get(math.inf, 0.0)
    if total <= 0:
        return math.nan
    bound = max((b for b in new if b <= limit_s), default=None)
    inside = 0.0 if bound is None else new[bound] - old.get(bound, 0.0)
    return inside / total


# ---- the decision ----------------------------------------------------------------------------
@dataclass(slots=True)
class Split:
    prefill: int
    decode: int

    @property
    def name(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(slots=True)
class Decision:
    current: Split
    best: Split
    predicted: dict[str, dict[str, float]]    # split name -> goodput, SLO attainment, TTFT p99, TPOT p99
    change: bool                              # the best split wins by more than the hysteresis

    def describe(self) -> str:
        def fig(name: str) -> str:
            p = self.predicted[name]
            return (f"{name} goodput {p['goodput']:.2f} req/s ({p['attainment']:.0%} within SLOs, TTFT p99 "
                    f"{p['ttft_p99_ms']:.0f} ms, TPOT p99 {p['tpot_p99_ms']:.1f} ms)")
        if self.best == self.current:
            return f"keep {self.current.name}: predicted {fig(self.current.name)}; no split does better"
        verdict = "move to" if self.change else "keep (below the hysteresis):"
        return f"{verdict} {self.best.name}: predicted {fig(self.best.name)} against {fig(self.current.name)}"


def decide(cost: CostModel, plan: PlanConfig, current: Split, traffic: Traffic, hysteresis: float,
           budget: int = 0) -> Decision:
    """Simulate every prefill:decode split of the current workers on the window's traffic, at the
    workers' step token budget (0: the first of --chunk-budgets), on --cores shared cores when
    given (workers that outnumber them share them), else a core per worker."""
    slos = parse_slos(plan.slos)
    budget = budget or int(plan.chunk_budgets.split(",")[0])
    workload = traffic.workload(plan.num_prompts, plan.seed)
    total = current.prefill + current.decode
    predicted: dict[str, dict[str, float]] = {}
    for p in range(1, total):
        split = Split(p, total - p)
        m = simulate(cost, Candidate(prefill_workers=p, decode_workers=total - p, max_num_batched_tokens=budget,
                                     threads_per_worker=plan.threads_per_worker, shared_cores=plan.cores),
                     workload, plan.overheads, slos)
        predicted[split.name] = {"goodput": m["request_goodput"] or 0.0, "attainment": m["slo_attainment"] or 0.0,
                                 "ttft_p99_ms": m["p99_ttft_ms"], "tpot_p99_ms": m["p99_tpot_ms"]}
    splits = [Split(p, total - p) for p in range(1, total)]
    best = max(splits, key=lambda s: (round(predicted[s.name]["goodput"], 6), -predicted[s.name]["ttft_p99_ms"]))
    now = predicted[current.name]["goodput"]
    change = best != current and predicted[best.name]["goodput"] > now * (1 + hysteresis) + 1e-9
    return Decision(current, best, predicted, change)


# ---- the loop ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Members:
    """The router's members by role, as the planner sees them."""

    prefill: list[Any]
    decode: list[Any]
    colocated: int

    @property
    def split(self) -> Split:
        return Split(len(self.prefill), len(self.decode))

    @property
    def budget(self) -> int:
        """The step token budget the workers report (the largest; 0: none known)."""
        return max((w.max_num_batched_tokens for w in [*self.prefill, *self.decode]), default=0)


class Planner:
    def __init__(self, cost: CostModel, plan: PlanConfig, watch: WatchConfig, credentials,
                 out: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cost, self.plan, self.watch, self.credentials = cost, plan, watch, credentials
        self.out = out or sys.stdout
        self.clock = clock
        self.streak: tuple[str, int] = ("", 0)     # the change called for, and in how many windows in a row
        self.changed_at: float | None = None

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def scrape(self) -> Scrape:
        with urllib.request.urlopen(f"http://{self.watch.router_metrics}/metrics", timeout=10) as response:
            return Scrape.parse(response.read().decode(), self.clock())

    def members(self) -> Members:
        from pdserve.v1 import membership_pb2 as m
        from pdserve.v1 import membership_pb2_grpc, worker_pb2
        with self.credentials.sync_channel(self.watch.router) as channel:
            listed = membership_pb2_grpc.MembershipStub(channel).ListWorkers(m.ListWorkersRequest(), timeout=10).workers
        live = [w for w in listed if w.state == m.MEMBER_STATE_SERVING]
        return Members([w for w in live if w.role == worker_pb2.WORKER_ROLE_PREFILL],
                       [w for w in live if w.role == worker_pb2.WORKER_ROLE_DECODE],
                       sum(1 for w in live if w.role == worker_pb2.WORKER_ROLE_BOTH))

    def window(self, traffic: Traffic, members: Members) -> Decision | None:
        """Plan on one window; apply the change when it is confirmed. None: nothing to plan on."""
        if members.colocated or not members.prefill or not members.decode:
            self.say(f"window: {traffic.describe()}; members {members.split.name} (+{members.colocated} colocated): "
                     f"nothing to re-plan")
            return None
        if traffic.requests < self.watch.min_window_requests:
            self.say(f"window: {traffic.describe()}; fewer than {self.watch.min_window_requests} requests: "
                     f"not planned on")
            self.streak = ("", 0)
            return None
        decision = decide(self.cost, self.plan, members.split, traffic, self.watch.hysteresis, members.budget)
        wanted = decision.best.name if decision.change else ""
        count = self.streak[1] + 1 if wanted and wanted == self.streak[0] else (1 if wanted else 0)
        self.streak = (wanted, count)
        note = ""
        if decision.change:
            dwell = None if self.changed_at is None else self.clock() - self.changed_at
            if count < self.watch.confirmations:
                note = f" (confirmed {count} of {self.watch.confirmations} windows)"
            elif dwell is not None and dwell < self.watch.min_dwell_s:
                note = f" (the last change was {dwell:.0f}s ago, min dwell {self.watch.min_dwell_s:g}s)"
            elif not self.watch.apply:
                note = " (not applied: --apply is off)"
            else:
                note = " (applying)"
        self.say(f"window: {traffic.describe()}; {decision.describe()}{note}")
        self.say("decision " + json.dumps({"current": decision.current.name, "best": decision.best.name,
                                           "change": decision.change, "applied": note == " (applying)",
                                           "predicted": decision.predicted}))
        if note == " (applying)":
            self.apply(decision, members)
            self.changed_at = self.clock()
            self.streak = ("", 0)
        return decision

    def apply(self, decision: Decision, members: Members) -> None:
        """Switch the workers the best split moves, the least loaded first, one at a time."""
        from pdserve.v1 import membership_pb2 as m
        from pdserve.v1 import membership_pb2_grpc, worker_pb2
        moves = decision.current.prefill - decision.best.prefill
        source, role = (members.prefill, "decode") if moves > 0 else (members.decode, "prefill")
        enum = worker_pb2.WORKER_ROLE_DECODE if role == "decode" else worker_pb2.WORKER_ROLE_PREFILL
        with self.credentials.sync_channel(self.watch.router) as channel:
            stub = membership_pb2_grpc.MembershipStub(channel)
            for worker in sorted(source, key=lambda w: w.inflight)[:abs(moves)]:
                t0 = time.monotonic()
                stub.SwitchRole(m.SwitchRoleRequest(address=worker.address, role=enum), timeout=300)
                self.say(f"switched {worker.address} to {role} in {time.monotonic() - t0:.1f}s")

    def run(self) -> int:
        last = self.scrape()
        windows = 0
        while not self.watch.max_windows or windows < self.watch.max_windows:
            time.sleep(self.watch.interval_s)
            now = self.scrape()
            self.window(Traffic.between(last, now, parse_slos(self.plan.slos)), self.members())
            last = now
            windows += 1
        return 0


def run_watch(plan: PlanConfig, watch: WatchConfig, credentials, out: TextIO | None = None) -> int:
    if not plan.profile:
        raise ValueError("--profile is required: make one with `pdserve profile --model DIR`")
    if not parse_slos(plan.slos):
        raise ValueError("--watch needs at least one --slo (the goodput it keeps): e.g. --slo ttft:500 --slo tpot:60")
    planner = Planner(CostModel.load(plan.profile), plan, watch, credentials, out)
    planner.say(f"pdserve plan --watch: the router at {watch.router} (metrics {watch.router_metrics}), a window every "
                f"{watch.interval_s:g}s, SLOs {', '.join(plan.slos)}; changes "
                f"{'applied' if watch.apply else 'only printed (no --apply)'}")
    return planner.run()
