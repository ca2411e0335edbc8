"""Where a request goes: which decode worker, which prefill worker, and whether the prompt is
prefilled remotely (KV shipped) or locally on the decode worker.

``kv-aware`` (the default) scores candidates by their cost to serve, in estimated milliseconds
(services/router/placement.py): the uncached prompt tokens each would compute (from the prefix index
the workers' KV events keep, services/router/prefix_index.py; blocks a worker holds only in a KV
tier count as held, plus their load at its measured cost per block), the prompt tokens queued ahead and the
sequences running there, the KV blocks a decode worker lacks and would be shipped, its decode
load over the request's output, and cache affinity: the prefill time of the prefix blocks
another decode worker holds and it lacks (a prefix stays where it is until that worker's extra
load costs more than the prefix). ``load`` is the policy before it: decode workers by fewest
requests in flight then most free blocks, prefill workers by fewest queued prompt tokens.

Disaggregation ``always`` prefills every prompt on a prefill worker; ``conditional`` prefills it
on the chosen decode worker when that is cheaper (the rule and its threshold: cost_model.py).
A colocated member among prefill and decode workers always prefills its own prompts.

The costs the router routes by, in milliseconds, from online estimates.

Learned, never configured:

* a worker's step cost, ``base + ms_per_token * tokens`` (steps that compute prompt tokens), and
  what one more decoding sequence adds to a step, ``ms_per_seq`` (decode-only steps): fitted by
  the worker from its own steps and published in its status, read here as the step-cost model's
  ``StepCostView`` (engine/step_cost.py, the model the planner's simulator prices steps with too).
  A worker that has not computed a prompt yet borrows the per-token cost of those that have
  (same model, same kind of machine), else a small default;
* the KV transfer's exposed time: from each remote prefill's ``KVDelivered`` (the blocks sent
  after the token was sampled, and how long they took to be acknowledged), fitted as a fixed
  part (the last send's round trip) plus a part per block;
* each route's fixed overhead: the router's own TTFT minus what the worker reports as queue +
  prefill time (RPC hops, Reserve, the first token's relay), a moving average per route.

The prefill of ``u`` uncached prompt tokens on a worker with ``q`` prompt tokens queued ahead,
step budget ``B`` and ``R`` sequences decoding (``StepCostView.prefill_ms``):

    prefill_ms = ms_per_token * (q + u) + (base + ms_per_seq * R) * (1 + (q + u) / B)

Conditional disaggregation compares, per request and decode worker D (best prefill worker P):

    remote = prefill_ms(P) + overhead_remote + transfer_ms(blocks D lacks)
    local  = prefill_ms(D) + overhead_local  + itl_weight * R_D * ms_per_token_D * u_D

the last term being the delay a local chunk of u_D tokens adds to the steps of D's R_D
running sequences (the inter-token latency inflation). Local wins when it is smaller. With no
prefix cached anywhere (u the same on both) this is a threshold on u: ``threshold_tokens``.

KV-aware routing adds to a decode worker's cost the prefill time (at P's speed) of the prompt's
blocks another decode worker holds and it lacks, times ``affinity_weight``: ``affinity_ms``.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from pdserve.engine.config import STEP_TOKENS
from pdserve.engine.step_cost import Load, StepCost, StepCostView
from pdserve.services.router.config import DISAGGREGATION_MODES, ROUTING_POLICIES
from pdserve.services.router.worker_pool import NoWorker, WorkerHandle, WorkerSet
from pdserve.v1 import worker_pb2


log = logging.getLogger(__name__)

THRESHOLD_LOG_INTERVAL_S = 5.0
# A remote route reserves decode KV only while the prefill worker it would use is not backlogged:
# less than a step (its max_num_batched_tokens) of prompt tokens queued there, or an estimated
# wait (its learned step costs) under PREFILL_AHEAD_S. Requests past that wait in the router's
# admission queue holding nothing. Without it a burst reserves all the decode KV at once; once the
# prefill queue takes longer than the decode workers' --kv-lease-max-s (300 s), reservations lapse
# before their KV arrives, every prefill is wasted, and nothing completes (seen on a loaded 2-core
# CPU, where a 2,048-token step of SmolLM2-135M took a minute and 40 reservations were made at
# once). A bound in seconds, not in steps: a worker with a small chunk budget (8 tokens in the fault
# tests) must still hold a few prompts queued, and 30 s is a tenth of the lease cap.
PREFILL_AHEAD_S = 30.0


@dataclass(slots=True)
class Route:
    """One decode worker's offer for a request."""

    decode: WorkerHandle
    local: bool                    # prefill on the decode worker itself
    decode_cached_blocks: int      # leading blocks it is expected to hold
    local_ms: float                # estimated cost of each route (0: not considered)
    remote_ms: float
    threshold_tokens: float | None  # the decode worker's local-prefill threshold now (None: not conditional)
    cost: float                    # what candidates are ranked by


class Placement:
    def __init__(self, pool: WorkerSet, routing: str = "kv-aware", disaggregation: str = "always",
                 cost_model: CostModel | None = None,
                 tokens_left: Callable[[WorkerHandle], list[int]] = lambda worker: []) -> None:
        """pool: the router's WorkerPool, or any WorkerSet (the planner's simulated workers);
        tokens_left(worker): output tokens still to come of each request this router has placed
        on a decode (or colocated) worker."""
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {routing!r}")
        if disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation must be one of {DISAGGREGATION_MODES}, got {disaggregation!r}")
        self.pool = pool
        self.routing = routing
        self.disaggregation = disaggregation
        self.costs = cost_model or CostModel()
        self.tokens_left = tokens_left
        self._threshold_logged: dict[str, tuple[float, float]] = {}   # worker -> (threshold, when)

    @property
    def kv_aware(self) -> bool:
        return self.routing == "kv-aware"

    @property
    def conditional(self) -> bool:
        return self.disaggregation == "conditional" and not self.pool.colocated

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def describe(self) -> str:
        text = f"routing {self.routing}, disaggregation {self.disaggregation}"
        if self.conditional:
            text += (f": prefill on the decode worker D when prefill_ms(D) + overhead_local + "
                     f"{self.costs.itl_weight:g} * running(D) * ms_per_token(D) * uncached(D) < prefill_ms(P) + "
                     f"overhead_remote + transfer_ms(blocks D lacks)")
        return text

    # ---- estimates of one worker ----------------------------------------------------------
    def step_cost(self, worker: WorkerHandle) -> StepCostView:
        return self.costs.step_cost(worker.status, [w.status for w in self.pool.workers if w.status is not None])

    @staticmethod
    def load(worker: WorkerHandle) -> Load:
        s = worker.status
        queued = max(s.num_queued_prompt_tokens if s else 0, worker.inflight_prompt_tokens)
        running = 0 if worker.role == "prefill" else max(s.num_running if s else 0, worker.inflight)
        return Load(queued, running)

    def _matched(self, worker: WorkerHandle, keys: Sequence[int]) -> int:
        return worker.index.matched_blocks(keys) if self.kv_aware else 0

    # ---- prefill ------------------------------------------------------------------------
    def pick_prefill(self, keys: Sequence[int], n_tokens: int, exclude: set[str] = frozenset()
                     ) -> tuple[WorkerHandle, float]:
        """The prefill worker to use and its estimated cost (ms). Raises NoWorker."""
        healthy = [w for w in self.pool.healthy("prefill") if w.address not in exclude] or self.pool.healthy("prefill")
        if not healthy:
            raise NoWorker("prefill")
        if not self.kv_aware:
            best = min(healthy, key=lambda w: w.inflight_prompt_tokens + (w.status.num_queued_prompt_tokens
                                                                          if w.status else 0))
            return best, self._prefill_cost(best, keys, n_tokens)
        scored = [(self._prefill_cost(w, keys, n_tokens), -w.free_blocks, i) for i, w in enumerate(healthy)]
        cost, _, i = min(scored)
        return healthy[i], cost

    def prefill_backlogged(self, keys: Sequence[int], n_tokens: int, exclude: set[str] = frozenset()) -> bool:
        """Whether the prefill worker a remote route would use is backlogged (PREFILL_AHEAD_S of
        queued work); False with none healthy: the route waits for one anyway."""
        try:
            worker, _ = self.pick_prefill(keys, n_tokens, exclude)
        except NoWorker:
            return False
        cost, load = self.step_cost(worker), self.load(worker)
        if load.queued_tokens < cost.budget:
            return False   # less than a step: never held (it would idle)
        return self.costs.prefill_ms(cost, load, 0) >= PREFILL_AHEAD_S * 1e3

    def _prefill_cost(self, worker: WorkerHandle, keys: Sequence[int], n_tokens: int) -> float:
        uncached = self.uncached(worker, keys, n_tokens)
        return self.costs.prefill_ms(self.step_cost(worker), self.load(worker), uncached) + \
            self.tier_load_ms(worker, keys)

    def tier_load_ms(self, worker: WorkerHandle, keys: Sequence[int]) -> float:
        """Loading the prompt's leading blocks the worker holds only in a KV tier (host RAM or
        disk) back into its pool, at the worker's measured cost per block (0 before it measured
        one: priced as a pool hit). Those blocks count as held: a load, not a recompute."""
        per_block = worker.status.kv_tier_load_ms_per_block if worker.status is not None else 0.0
        if not self.kv_aware or not per_block:
            return 0.0
        return worker.index.tiered_blocks(keys) * per_block

    def uncached(self, worker: WorkerHandle, keys: Sequence[int], n_tokens: int) -> int:
        return max(1, n_tokens - self._matched(worker, keys) * self.block_size)

    @staticmethod
    def fits(worker: WorkerHandle, n_tokens: int) -> bool:
        """Whether the worker's free KV blocks, as it last reported them, hold a sequence of n_tokens:
        a decode worker that cannot is not asked to reserve (one not heard from yet is)."""
        s = worker.status
        bs = s.block_size if s is not None and s.block_size else 1
        return s is None or worker.free_blocks >= -(-n_tokens // bs)

    # ---- decode (and the route) -------------------------------------------------------------
    def decode_routes(self, keys: Sequence[int], n_tokens: int, max_tokens: int, exclude: set[str] = frozenset(),
                      session_worker: str | None = None) -> list[Route]:
        """Every healthy decode worker's offer, best first. session_worker: the address of the
        worker the request's session last ended on (services/router/routes.py, SessionTable): it may prefill
        the request itself (priced as conditional disaggregation prices it), and the load policy
        tries it first. Raises NoWorker."""
        candidates = self.pool.decode_candidates(exclude)   # load order: fewest in flight, most free blocks
        if session_worker is not None:
            candidates.sort(key=lambda w: w.address != session_worker)   # stable: load order otherwise
        if self.pool.colocated:   # prefill and decode where the request goes: by both costs
            routes = []
            for i, w in enumerate(candidates):
                cost = float(i)
                if self.kv_aware:
                    step, load = self.step_cost(w), self.load(w)
                    cost = (self.costs.prefill_ms(step, load, self.uncached(w, keys, n_tokens))
                            + self.tier_load_ms(w, keys) + self._decode_ms(candidates, w, load, max_tokens))
                routes.append(Route(w, True, self._matched(w, keys), 0.0, 0.0, None, cost))
            routes.sort(key=lambda r: (r.cost, -r.decode.free_blocks))
            return routes
        try:
            prefill, prefill_ms = self.pick_prefill(keys, n_tokens, exclude)
        except NoWorker:
            prefill, prefill_ms = None, math.inf
        bs = self.block_size or 1
        n_blocks = -(-n_tokens // bs)
        held_by = {d.address: self._matched(d, keys) for d in candidates}
        most_held = max(held_by.values(), default=0)
        prefill_cost = self.step_cost(prefill) if prefill is not None else None
        routes = []
        for i, d in enumerate(candidates):
            held = held_by[d.address]
            tier_d = self.tier_load_ms(d, keys)   # either route loads what d holds in a tier
            remote = prefill_ms + self.costs.overhead_ms["remote"].value + self.costs.transfer_ms(n_blocks - held) + \
                tier_d
            local, threshold = 0.0, None
            cost_d = self.step_cost(d)
            load_d = self.load(d)
            prefills_itself = d.role == "both"   # a colocated member among P/D workers
            may_prefill = self.conditional or d.address == session_worker
            if may_prefill or prefills_itself:
                local = self.costs.local_ms(cost_d, load_d, max(1, n_tokens - held * bs)) + tier_d
                if prefill is not None and not prefills_itself:
                    threshold = self.costs.threshold_tokens(cost_d, load_d, self.step_cost(prefill),
                                                            self.load(prefill), bs)
                    self._log_threshold(d, threshold, cost_d, load_d)
            is_local = prefills_itself or (may_prefill and local < remote)
            if self.kv_aware:
                cost = (local if is_local else remote) + self._decode_ms(candidates, d, load_d, max_tokens)
                if prefill_cost is not None:
                    cost += self.costs.affinity_ms(prefill_cost, bs, most_held - held)
            else:
                cost = float(i)
            routes.append(Route(d, is_local, held, local, remote if math.isfinite(remote) else 0.0, threshold, cost))
        if prefill is None and any(r.local for r in routes):
            # no healthy prefill worker: the routes that need one wait for it (after their
            # reservation, outside the admission queue); while another serves, they are not offered
            routes = [r for r in routes if r.local]
        routes.sort(key=lambda r: (r.cost, -r.decode.free_blocks))
        return routes

    def _decode_ms(self, peers: list[WorkerHandle], worker: WorkerHandle, load: Load, max_tokens: int) -> float:
        """What the sequences decoding there add to this request's decode: the decode steps they
        share with it (each runs until its own output ends: the router knows the tokens left of
        those it placed, and counts any other running one for the whole output) times their cost
        per sequence in a step. That cost is the peers' mean, so that noise between the fits of
        identical workers cannot outweigh a cached prefix."""
        per_seq = sum(self.step_cost(w).ms_per_seq for w in peers) / len(peers)
        known = [min(left, max_tokens) for left in self.tokens_left(worker)]
        shared_steps = sum(known) + max(0, load.running - len(known)) * max_tokens
        return per_seq * shared_steps

    def threshold_now(self, decode: WorkerHandle) -> float:
        """The decode worker's local-prefill threshold against the best prefill worker now (metrics)."""
        try:
            prefill, _ = self.pick_prefill((), 1)
        except NoWorker:
            return math.inf
        return self.costs.threshold_tokens(self.step_cost(decode), self.load(decode), self.step_cost(prefill),
                                           self.load(prefill), self.block_size or 1)

    def _log_threshold(self, worker: WorkerHandle, threshold: float, cost: StepCostView, load: Load) -> None:
        """Say so when a decode worker's threshold moved by a fifth or more (at most every few seconds)."""
        now = time.monotonic()
        last = self._threshold_logged.get(worker.address)
        if last is not None:
            before, when = last
            same = (before == threshold or (math.isfinite(before) and math.isfinite(threshold)
                                            and abs(threshold - before) <= 0.2 * max(before, 1.0)))
            if same or now - when < THRESHOLD_LOG_INTERVAL_S:
                return
        self._threshold_logged[worker.address] = (threshold, now)
        log.info("local-prefill threshold of %s: %s uncached tokens (decode step %.3g ms + %.3g ms/token%s, "
                 "%d running, %d queued; transfer %.3g ms/block; overhead local %.3g ms, remote %.3g ms)",
                 worker.address, "unbounded" if math.isinf(threshold) else f"{threshold:.0f}", cost.base_ms,
                 cost.ms_per_token, "" if cost.learned else " (borrowed)", load.running, load.queued_tokens,
                 self.costs.transfer_ms_per_block, self.costs.overhead_ms["local"].value,
                 self.costs.overhead_ms["remote"].value)


DEFAULT_MS_PER_TOKEN = 0.1       # before any worker has stepped
DEFAULT_BASE_MS = 1.0
DEFAULT_TRANSFER_MS_PER_BLOCK = 0.1
TRANSFER_DECAY = 0.95            # the transfer fit follows the last ~20 hand-offs
TRANSFER_MIN_SPREAD_BLOCKS = 1.0
EWMA_ALPHA = 0.1
ROUTES = ("remote", "local")


@dataclass(slots=True)
class Ewma:
    value: float
    samples: int = 0

    def observe(self, x: float) -> None:
        self.value = x if not self.samples else self.value + EWMA_ALPHA * (x - self.value)
        self.samples += 1


class CostModel:
    def __init__(self, itl_weight: float = 1.0, affinity_weight: float = 1.0) -> None:
        if itl_weight < 0:
            raise ValueError(f"itl_weight must be >= 0, got {itl_weight}")
        if affinity_weight < 0:
            raise ValueError(f"affinity_weight must be >= 0, got {affinity_weight}")
        self.itl_weight = itl_weight
        self.affinity_weight = affinity_weight
        self.transfer = StepCost(decay=TRANSFER_DECAY, min_spread=TRANSFER_MIN_SPREAD_BLOCKS)
        self.overhead_ms = {route: Ewma(0.0) for route in ROUTES}

    # ---- learning ---------------------------------------------------------------------
    def observe_transfer(self, blocks: int, ms: float) -> None:
        """One hand-off's exposed part: blocks sent after the token was sampled, and the time to
        their acknowledgement (a fixed part, the last send's round trip, plus a part per block)."""
        if blocks > 0 and ms >= 0:
            self.transfer.observe(blocks, ms)

    @property
    def transfer_ms_per_block(self) -> float:
        return self.transfer.coefficients()[1] if self.transfer.fitted else DEFAULT_TRANSFER_MS_PER_BLOCK

    @property
    def transfer_base_ms(self) -> float:
        return self.transfer.coefficients()[0]

    def observe_overhead(self, route: str, ttft_ms: float, worker_ms: float) -> None:
        if route in self.overhead_ms:
            self.overhead_ms[route].observe(max(0.0, ttft_ms - worker_ms))

    # ---- estimates --------------------------------------------------------------------
    @staticmethod
    def step_cost(status: worker_pb2.WorkerStatus | None, peers: list[worker_pb2.WorkerStatus]) -> StepCostView:
        budget = status.max_num_batched_tokens if status is not None and status.max_num_batched_tokens else STEP_TOKENS
        decoders = [p.decode_ms_per_seq for p in peers if p.decode_ms_per_seq > 0]
        if status is not None and status.decode_ms_per_seq > 0:
            per_seq = status.decode_ms_per_seq
        else:   # not identified here (or a prefill worker): its peers' mean, else the token cost
            per_seq = sum(decoders) / len(decoders) if decoders else 0.0
        if status is not None and status.step_ms_per_token > 0:
            return StepCostView(status.step_base_ms, status.step_ms_per_token, budget, True,
                                per_seq or status.step_ms_per_token)
        # No prompt computed here yet (a decode worker that has only decoded): a prompt token costs
        # what it costs its peers (same model, same kind of machine); the fixed part of a step is
        # its own when its decode steps gave one.
        fitted = [p for p in peers if p.step_ms_per_token > 0]
        per_token = sum(p.step_ms_per_token for p in fitted) / len(fitted) if fitted else DEFAULT_MS_PER_TOKEN
        if status is not None and status.step_base_ms > 0:
            base = status.step_base_ms
        else:
            base = sum(p.step_base_ms for p in fitted) / len(fitted) if fitted else DEFAULT_BASE_MS
        return StepCostView(base, per_token, budget, False, per_seq or per_token)

    @staticmethod
    def prefill_ms(cost: StepCostView, load: Load, uncached: int) -> float:
        return cost.prefill_ms(load, uncached)

    def itl_inflation_ms(self, cost: StepCostView, load: Load, uncached: int) -> float:
        """Delay a local prefill of uncached tokens adds to the running sequences, weighted."""
        return self.itl_weight * load.running * cost.ms_per_token * uncached

    def remote_ms(self, prefill: StepCostView, prefill_load: Load, prefill_uncached: int,
                  shipped_blocks: int) -> float:
        return (self.prefill_ms(prefill, prefill_load, prefill_uncached) + self.overhead_ms["remote"].value
                + self.transfer_ms(shipped_blocks))

    def transfer_ms(self, blocks: int) -> float:
        """Exposed transfer of a hand-off that ships blocks (none: no transfer at all)."""
        return self.transfer_base_ms + self.transfer_ms_per_block * blocks if blocks > 0 else 0.0

    def affinity_ms(self, prefill: StepCostView, block_size: int, blocks_held_elsewhere: int) -> float:
        """What serving a request away from the decode worker holding its prefix costs beyond the
        transfer: the prefill time of the blocks another decode worker holds and this one lacks."""
        return self.affinity_weight * prefill.ms_per_token * block_size * blocks_held_elsewhere

    def local_ms(self, decode: StepCostView, decode_load: Load, decode_uncached: int) -> float:
        return (self.prefill_ms(decode, decode_load, decode_uncached) + self.overhead_ms["local"].value
                + self.itl_inflation_ms(decode, decode_load, decode_uncached))

    def threshold_tokens(self, decode: StepCostView, decode_load: Load, prefill: StepCostView,
                         prefill_load: Load, block_size: int) -> float:
        """Uncached prompt tokens up to which local prefill on decode is cheaper, when neither
        worker holds the prompt's prefix (math.inf: at any length; 0: never)."""
        def line(cost: StepCostView, load: Load, extra_slope: float, extra_const: float) -> tuple[float, float]:
            per_step = cost.decode_step_ms(load.running)
            slope = cost.ms_per_token + per_step / cost.budget + extra_slope
            const = cost.ms_per_token * load.queued_tokens + per_step * (1 + load.queued_tokens / cost.budget)
            return slope, const + extra_const
        slope_l, const_l = line(decode, decode_load, self.itl_weight * decode_load.running * decode.ms_per_token,
                                self.overhead_ms["local"].value)
        slope_r, const_r = line(prefill, prefill_load, self.transfer_ms_per_block / block_size,
                                self.overhead_ms["remote"].value + self.transfer_base_ms)
        if slope_l <= slope_r:
            return math.inf if const_l <= const_r else 0.0
        return max(0.0, (const_r - const_l) / (slope_l - slope_r))
