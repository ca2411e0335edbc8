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

With ``--spares`` (idle worker processes that are not members) the planner also sizes the
deployment: it simulates every total from the workers it was given to those plus the spares,
picks the fewest workers whose best split keeps ``--target-attainment`` of the requests within
the SLOs, and adds spares (``Membership.AddWorker``) or drains and removes them again
(``Membership.RemoveWorker``) to get there. It never removes a worker it was not given as spare.
Every window's decision is printed, with the predicted figures of every split it simulated.

What the planner reads is not trusted further than it must be: the scrape sends the metrics
token when one is configured (``--metrics-token-file`` or ``$PDSERVE_METRICS_TOKEN``), reads at
most ``MAX_METRICS_BYTES`` within ``SCRAPE_TIMEOUT_S`` in all, skips a malformed line (counted,
said once) and ignores a value that is not finite, and a window whose mean lengths exceed the
model's is not planned on (no simulation of absurd prompts). ``--apply`` against metrics off loopback needs the token.
The membership API is dialed under the internal plane's rule (``require_secure_internal_plane``):
a non-loopback ``--router`` needs mutual TLS or ``--insecure-internal-plane``.
"""
from __future__ import annotations

import json
import math
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import grpc

from pdserve.engine.settings import setting
from pdserve.services.common.metrics import METRICS_PATH, read_metrics_token
from pdserve.services.common.proofs import host_of, is_host_port, is_loopback
from pdserve.services.common.security import require_secure_internal_plane
from pdserve.services.planner.cost_model import CostModel
from pdserve.services.planner.plan import PlanConfig, Workload, parse_slos, simulate
from pdserve.services.planner.simulator import Candidate

ROUTER_METRICS = ("request_success_total", "request_failure_total", "prompt_tokens_total", "generation_tokens_total",
                  "num_requests_running")   # the last a gauge: requests in flight through the router
HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "tpot": "time_per_output_token_seconds"}
MAX_METRICS_BYTES = 16 << 20    # a /metrics answer larger than this is refused
MAX_HEAD_BYTES = 64 << 10       # its status line and headers
SCRAPE_TIMEOUT_S = 10.0         # the whole scrape: connect, send, read every byte
DEFAULT_MAX_LEN = 1 << 17       # the longest mean prompt + output planned on when the profile names no limit


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
    spares: str = setting("", "watch: comma-separated HOST:PORT of idle workers (running, not members) the planner "
                              "may add when the traffic needs more workers than the deployment has, and remove "
                              "again (drained) when it needs fewer; none: it only moves roles", metavar="ADDRS")
    target_attainment: float = setting(0.95, "watch, with --spares: the deployment is sized to the fewest workers "
                                             "whose best split is predicted to keep this fraction of requests "
                                             "within the SLOs")
    metrics_token_file: str | None = setting(None, "watch: file holding the router's metrics token, sent with each "
                                                   "scrape as a bearer token (default: $PDSERVE_METRICS_TOKEN, else "
                                                   "none); --apply with --router-metrics off loopback needs it",
                                             metavar="FILE")
    insecure_internal_plane: bool = setting(False, "watch: allow a non-loopback --router without mutual TLS (the "
                                                   "cluster token's proofs and the role changes travel unencrypted; "
                                                   "for trusted networks)")

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
        if not 0 < self.target_attainment <= 1:
            raise ValueError(f"target_attainment must be in (0, 1], got {self.target_attainment}")
        bad = [a for a in self.spare_addresses if not is_host_port(a)]
        if bad:
            raise ValueError(f"spares must be HOST:PORT addresses, got {bad[0]!r}")

    @property
    def spare_addresses(self) -> list[str]:
        return [a.strip() for a in self.spares.split(",") if a.strip()]


# ---- what the router's metrics say ------------------------------------------------------------
@dataclass(slots=True)
class Scrape:
    """One read of the router's /metrics: counters summed over labels, histogram buckets by le."""

    at: float
    counters: dict[str, float]
    buckets: dict[str, dict[float, float]]   # histogram name -> upper bound -> cumulative count
    malformed: int = 0                       # lines skipped: not "SERIES VALUE" with a number
    first_malformed: str = ""

    @classmethod
    def parse(cls, text: str, at: float) -> "Scrape":
        counters: dict[str, float] = {}
        buckets: dict[str, dict[float, float]] = {}
        malformed, first = 0, ""
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            try:
                name, le, value = _sample(line)
            except ValueError:
                malformed, first = malformed + 1, first or line[:80]
                continue
            if not math.isfinite(value):
                continue   # valid exposition (a gauge at +Inf), but nothing the planner can sum
            if name.endswith("_bucket"):
                if le is not None:
                    hist = buckets.setdefault(name.removesuffix("_bucket"), {})
                    hist[le] = hist.get(le, 0.0) + value
                continue
            counters[name] = counters.get(name, 0.0) + value
        return cls(at, counters, buckets, malformed, first)


def _sample(line: str) -> tuple[str, float | None, float]:
    """(name without the pdserve: prefix, a bucket's upper bound or None, value) of one sample line;
    ValueError when it is not one (no name, a value or bound that is not a number, a NaN bound)."""
    series, value = line.rsplit(" ", 1)
    name, _, labels = series.partition("{")
    number = float(value)
    if not name:
        raise ValueError(line)
    le = next((part.split("=", 1)[1].strip('"') for part in labels.rstrip("}").split(",") if part.startswith("le=")),
              None)
    bound = None if le is None else (math.inf if le == "+Inf" else float(le))
    if bound is not None and math.isnan(bound):
        raise ValueError(line)
    return name.removeprefix("pdserve:"), bound, number


def fetch_metrics(address: str, token: str | None = None, timeout_s: float = SCRAPE_TIMEOUT_S,
                  limit: int = MAX_METRICS_BYTES) -> str:
    """The text of http://ADDRESS/metrics: one HTTP/1.0 GET (the server closes the connection after
    its answer), the bearer token when given, at most limit bytes of body, every byte within
    timeout_s of the start. ValueError saying what went wrong otherwise (a refused token too)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    data = bytearray()
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.sendall(f"GET {METRICS_PATH} HTTP/1.0\r\nHost: {address}\r\n{auth}\r\n".encode())
            while chunk := _recv(sock, deadline, timeout_s):
                data += chunk
                if len(data) > limit + MAX_HEAD_BYTES:
                    raise ValueError(f"its answer is larger than {limit} bytes")
    except (OSError, ValueError) as exc:
        raise ValueError(f"the router's metrics at {address}: {exc}") from None
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split(b" ", 2)
    code = status[1].decode("ascii", "replace") if len(status) > 1 else "none"
    if code == "401":
        raise ValueError(f"the router's metrics at {address} refused the scrape (401): pass its token with "
                         f"--metrics-token-file FILE (or $PDSERVE_METRICS_TOKEN)")
    if code != "200" or len(head) > MAX_HEAD_BYTES:
        raise ValueError(f"the router's metrics at {address} answered {head[:80]!r}, not 200 OK")
    return body.decode("utf-8", "replace")


def _recv(sock: socket.socket, deadline: float, timeout_s: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ValueError(f"no complete answer within {timeout_s:g}s")
    sock.settimeout(left)
    try:
        return sock.recv(1 << 16)
    except socket.timeout:
        raise ValueError(f"no complete answer within {timeout_s:g}s") from None


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

    @property
    def total(self) -> int:
        return self.prefill + self.decode


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
        if self.best.total > self.current.total:
            verdict = "scale up to" if self.change else "keep (below the hysteresis):"
        elif self.best.total < self.current.total:
            verdict = "scale down to"
        else:
            verdict = "move to" if self.change else "keep (below the hysteresis):"
        return f"{verdict} {self.best.name}: predicted {fig(self.best.name)} against {fig(self.current.name)}"


def decide(cost: CostModel, plan: PlanConfig, current: Split, traffic: Traffic, hysteresis: float,
           budget: int = 0, spare: int = 0, removable: int = 0, target: float = 0.95) -> Decision:
    """Simulate every prefill:decode split of the current workers on the window's traffic, at the
    workers' step token budget (0: the first of --chunk-budgets), on --cores shared cores when
    given (workers that outnumber them share them), else a core per worker.

    With spare workers to add or removable ones to take away, every total in between is simulated
    too, and the deployment is sized to the fewest workers whose best split keeps target of the
    requests within the SLOs (the most there are, if none does). A larger one must also beat the
    current split's goodput by the hysteresis; a smaller one is enough as it is (it keeps the
    target)."""
    slos = parse_slos(plan.slos)
    budget = budget or int(plan.chunk_budgets.split(",")[0])
    workload = traffic.workload(plan.num_prompts, plan.seed)
    predicted: dict[str, dict[str, float]] = {}
    best_of: dict[int, Split] = {}
    for total in range(max(2, current.total - removable), current.total + spare + 1):
        splits = [Split(p, total - p) for p in range(1, total)]
        for split in splits:
            m = simulate(cost, Candidate(prefill_workers=split.prefill, decode_workers=split.decode,
                                         max_num_batched_tokens=budget, threads_per_worker=plan.threads_per_worker,
                                         shared_cores=plan.cores), workload, plan.overheads, slos)
            predicted[split.name] = {"goodput": m["request_goodput"] or 0.0,
                                     "attainment": m["slo_attainment"] or 0.0,
                                     "ttft_p99_ms": m["p99_ttft_ms"], "tpot_p99_ms": m["p99_tpot_ms"]}
        best_of[total] = max(splits, key=lambda s: (round(predicted[s.name]["goodput"], 6),
                                                    -predicted[s.name]["ttft_p99_ms"]))
    size = current.total
    if spare or removable:
        size = min((t for t, b in best_of.items() if predicted[b.name]["attainment"] >= target),
                   default=max(best_of))
    best = best_of[size]
    now = predicted[current.name]["goodput"]
    if best.total < current.total:
        change = True
    else:
        change = best != current and predicted[best.name]["goodput"] > now * (1 + hysteresis) + 1e-9
    return Decision(current, best, predicted, change)


# ---- the loop ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Members:
    """The router's members by role, as the planner sees them."""

    prefill: list[Any]
    decode: list[Any]
    colocated: int
    listed: set[str] = field(default_factory=set)   # every member's address, whatever its state

    @property
    def split(self) -> Split:
        return Split(len(self.prefill), len(self.decode))

    @property
    def budget(self) -> int:
        """The step token budget the workers report (the largest; 0: none known)."""
        return max((w.max_num_batched_tokens for w in [*self.prefill, *self.decode]), default=0)


class Planner:
    def __init__(self, cost: CostModel, plan: PlanConfig, watch: WatchConfig, credentials,
                 out: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 metrics_token: str | None = None) -> None:
        self.cost, self.plan, self.watch, self.credentials = cost, plan, watch, credentials
        self.out = out or sys.stdout
        self.clock = clock
        self.metrics_token = metrics_token
        self.malformed = 0       # metrics lines skipped so far (the first time said)
        self.max_len = int(cost.engine.get("max_model_len") or cost.model_config.get("max_position_embeddings")
                           or DEFAULT_MAX_LEN)
        self.streak: tuple[str, int] = ("", 0)     # the change called for, and in how many windows in a row
        self.changed_at: float | None = None

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def scrape(self) -> Scrape:
        scrape = Scrape.parse(fetch_metrics(self.watch.router_metrics, self.metrics_token), self.clock())
        if scrape.malformed and not self.malformed:
            self.say(f"metrics: skipped {scrape.malformed} malformed line(s) of {self.watch.router_metrics}, the first "
                     f"{scrape.first_malformed!r}; later ones are skipped and counted without a word")
        self.malformed += scrape.malformed
        return scrape

    def members(self) -> Members:
        from pdserve.v1 import membership_pb2 as m
        from pdserve.v1 import membership_pb2_grpc, worker_pb2
        with self.credentials.sync_channel(self.watch.router) as channel:
            listed = membership_pb2_grpc.MembershipStub(channel).ListWorkers(m.ListWorkersRequest(), timeout=10).workers
        live = [w for w in listed if w.state == m.MEMBER_STATE_SERVING]
        return Members([w for w in live if w.role == worker_pb2.WORKER_ROLE_PREFILL],
                       [w for w in live if w.role == worker_pb2.WORKER_ROLE_DECODE],
                       sum(1 for w in live if w.role == worker_pb2.WORKER_ROLE_BOTH), {w.address for w in listed})

    def spares(self, members: Members) -> tuple[list[str], list[Any]]:
        """The spare workers that are not members (to add), and the serving members that are spares
        (to take away again: the planner never removes a worker it was not given as spare)."""
        spares = self.watch.spare_addresses
        return ([a for a in spares if a not in members.listed],
                [w for w in [*members.prefill, *members.decode] if w.address in spares])

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
        n = max(traffic.requests, 1.0)
        if not 0 <= traffic.prompt_tokens / n + traffic.output_tokens / n <= self.max_len:
            self.say(f"window: mean prompt + output length past the model's {self.max_len} tokens (or below 0): "
                     f"the metrics are wrong; not planned on")
            self.streak = ("", 0)
            return None
        free, added = self.spares(members)
        decision = decide(self.cost, self.plan, members.split, traffic, self.watch.hysteresis, members.budget,
                          spare=len(free), removable=len(added), target=self.watch.target_attainment)
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
        """Reach the best split: add spare workers (in the roles it lacks) or remove the spares
        (from the roles it has too many of), then switch the roles still off, the least loaded
        first, one worker at a time. A refused call is printed, and the next window plans again."""
        from pdserve.v1 import membership_pb2 as m
        from pdserve.v1 import membership_pb2_grpc, worker_pb2
        best = decision.best
        enums = {"prefill": worker_pb2.WORKER_ROLE_PREFILL, "decode": worker_pb2.WORKER_ROLE_DECODE}
        with self.credentials.sync_channel(self.watch.router) as channel:
            stub = membership_pb2_grpc.MembershipStub(channel)

            def call(what: str, fn, request, timeout: float) -> None:
                t0 = time.monotonic()
                try:
                    fn(request, timeout=timeout)
                except grpc.RpcError as exc:
                    self.say(f"{what}: refused, {exc.code().name}: {exc.details()}")
                    return
                self.say(f"{what} in {time.monotonic() - t0:.1f}s")

            free, added = self.spares(members)
            prefill = len(members.prefill)
            for address in free[:max(0, best.total - decision.current.total)]:
                role = "prefill" if prefill < best.prefill else "decode"
                prefill += role == "prefill"
                call(f"added {address} as {role}", stub.AddWorker,
                     m.AddWorkerRequest(address=address, role=enums[role]), 60)
            extra = enums["prefill"] if prefill > best.prefill else enums["decode"]   # the role with too many
            for worker in sorted(added, key=lambda w: w.role != extra)[:max(0, decision.current.total - best.total)]:
                role = "prefill" if worker.role == enums["prefill"] else "decode"
                call(f"removed {worker.address} ({role})", stub.RemoveWorker,
                     m.DrainWorkerRequest(address=worker.address), 300)
            if best.total != decision.current.total:
                members = self.members()   # the roles as they are now
            moves = len(members.prefill) - best.prefill
            source, role = (members.prefill, "decode") if moves > 0 else (members.decode, "prefill")
            for worker in sorted(source, key=lambda w: w.inflight)[:abs(moves)]:
                call(f"switched {worker.address} to {role}", stub.SwitchRole,
                     m.SwitchRoleRequest(address=worker.address, role=enums[role]), 300)

    def run(self) -> int:
        last = self.scrape()   # a first scrape that fails is an error (a wrong address, a missing token)
        windows = 0
        while not self.watch.max_windows or windows < self.watch.max_windows:
            time.sleep(self.watch.interval_s)
            windows += 1
            try:
                now = self.scrape()
            except ValueError as exc:   # the next window spans this one too
                self.say(f"window: {exc}; not planned on")
                continue
            self.window(Traffic.between(last, now, parse_slos(self.plan.slos)), self.members())
            last = now
        return 0


def check_watch_security(watch: WatchConfig, credentials, metrics_token: str | None) -> None:
    """The membership API is dialed under the internal plane's rule, and --apply acts only on
    authenticated metrics when they come from off loopback (ValueError naming the flags)."""
    require_secure_internal_plane(credentials, "planner", dials=(watch.router,),
                                  insecure_plane=watch.insecure_internal_plane)
    if watch.apply and metrics_token is None and not is_loopback(host_of(watch.router_metrics)):
        raise ValueError(f"--apply with --router-metrics {watch.router_metrics[:80]} (not loopback) needs the "
                         f"router's metrics token, so that what the planner acts on is authenticated: pass "
                         f"--metrics-token-file FILE (or set $PDSERVE_METRICS_TOKEN)")


def run_watch(plan: PlanConfig, watch: WatchConfig, credentials, out: TextIO | None = None) -> int:
    metrics_token = read_metrics_token(watch.metrics_token_file)
    check_watch_security(watch, credentials, metrics_token)
    if not plan.profile:
        raise ValueError("--profile is required: make one with `pdserve profile --model DIR`")
    if not parse_slos(plan.slos):
        raise ValueError("--watch needs at least one --slo (the goodput it keeps): e.g. --slo ttft:500 --slo tpot:60")
    planner = Planner(CostModel.load(plan.profile), plan, watch, credentials, out, metrics_token=metrics_token)
    planner.say(f"pdserve plan --watch: the router at {watch.router} (metrics {watch.router_metrics}), a window every "
                f"{watch.interval_s:g}s, SLOs {', '.join(plan.slos)}; changes "
                f"{'applied' if watch.apply else 'only printed (no --apply)'}")
    return planner.run()
