"""The costs the router routes by, in milliseconds, from online estimates.

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

import math
from dataclasses import dataclass

from pdserve.engine.step_cost import Load, StepCost, StepCostView
from pdserve.v1 import worker_pb2

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
        budget = status.max_num_batched_tokens if status is not None and status.max_num_batched_tokens else 2048
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
