"""What an engine step costs: the one step-cost model, shared by the engine (its online fit),
the router (placement, SLO prediction) and the planner (its profile, its simulator).

A step's cost is a non-negative linear function of what it holds, ``step_features`` of a step
(prefill chunks with their context, decode sequences with theirs):

    t = c0 + c_pt * prefill_tokens + c_ps * prefill_seqs + c_pa * prefill_attention
          + c_ds * decode_seqs + c_dc * decode_context

prefill_attention = sum over chunks of n * (context + n / 2) / 1000 (causal attention work),
decode_context = sum of the decode sequences' context lengths / 1000 (KV read per step). It is
known two ways:

* profiled (``StepCostModel``, fitted by ``pdserve profile``, services/planner/cost_model.py keeps
  it with the rest of a profile): every feature, one fit per step kind (prefill only, decode only,
  mixed), since the CPU backend runs pure decode steps through a different path. A decode-only
  step's cost is not linear in its batch size: the GEMMs change kernels with the row count (the
  bf16-weight kernel up to 32 rows on AVX2, AMX tiles up to 64, oneDNN beyond), so its fit is
  piecewise linear in decode_seqs, with knots at the profiled batch sizes (a basis of
  interpolation weights, ``batch_basis``), plus c_dc * decode_context;
* learned online by each worker from its own steps (``StepCost``, below), in milliseconds: c0,
  c_pt and c_ds only, published in its status and read by the router as a ``StepCostView``.

Online, a step's wall time is fitted as ``base_ms + ms_per_token * tokens``, where tokens
counts every token the step computes (a prefill chunk's tokens, one per decode). Both roles see varied
steps (prefill chunks of different sizes; decode batches that grow and shrink), so both
coefficients are identifiable; the fit is a least-squares line over exponentially decayed
sums, so it follows a machine that gets slower or faster within ~``1 / (1 - decay)`` steps.

Decode-only steps are fitted on their own, by sequences (``decode_step_cost`` of the engine),
and only steps that compute prompt tokens are fitted by tokens (``step_cost``): a decode step's
cost is mostly its fixed part (the weights are read once for the whole batch), so one more
running sequence adds that fit's slope to every step, and a decode worker that has only decoded
knows nothing of what a prompt token costs it (fitting its decode steps by tokens, through the
origin, prices a prompt token at a whole step per sequence, 5-10x too high).

The router reads these as a ``StepCostView`` (``prefill_ms``: how long a prompt takes to
prefill there; ``decode_step_ms``: a decode step with so many sequences) and builds its route
costs on them (services/router/placement.py): the inter-token latency inflation of a local
prefill, the KV transfer, cache affinity.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

MIN_SPREAD_TOKENS = 4.0   # below this spread of step sizes, the slope is not trusted: fit through the origin
MIN_SPREAD_SEQS = 1.0     # decode-only steps, by sequences: a batch that grows and shrinks by one or two
DECODE_FIT_DECAY = 0.995  # ... over ~200 steps (a few seconds of decoding): noise on a shared machine


@dataclass(slots=True)
class StepCost:
    decay: float = 0.98
    min_spread: float = MIN_SPREAD_TOKENS   # standard deviation of step sizes needed to trust a slope
    steps: int = 0
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")

    def observe(self, tokens: int, ms: float) -> None:
        if tokens <= 0 or ms < 0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._sx = self._sx * d + tokens
        self._sy = self._sy * d + ms
        self._sxx = self._sxx * d + tokens * tokens
        self._sxy = self._sxy * d + tokens * ms
        self.steps += 1

    @property
    def fitted(self) -> bool:
        return self.steps > 0

    def line(self) -> tuple[float, float] | None:
        """(base_ms, ms_per_token) when the steps identify both: sizes spread by at least
        min_spread, a positive slope and a non-negative base. None otherwise."""
        if not self._w:
            return None
        mx, my = self._sx / self._w, self._sy / self._w
        var = self._sxx / self._w - mx * mx
        if var >= self.min_spread ** 2:
            slope = (self._sxy / self._w - mx * my) / var
            if slope > 0 and my - slope * mx >= 0:
                return my - slope * mx, slope
        return None

    def coefficients(self) -> tuple[float, float]:
        """(base_ms, ms_per_token); (0, 0) before the first step. Without an identified line, all
        cost per token (through the origin): an upper bound on the slope, close to it only when
        steps are large against their fixed cost (prefill chunks; never decode batches)."""
        if not self._w:
            return 0.0, 0.0
        return self.line() or (0.0, self._sy / self._sx)


def published_costs(prompt_steps: StepCost, decode_steps: StepCost) -> tuple[float, float, float]:
    """What a worker publishes of its learned step costs (the fits of its steps that computed
    prompt tokens and of its decode-only steps): (base_ms, ms_per_token, ms_per_seq).
    ms_per_token is 0 until a step computed prompt tokens here (a decode worker that has only
    decoded: the router borrows a peer's); base_ms then comes from the decode-only fit. ms_per_seq
    is 0 unless the decode-only steps identify it (the router then uses its peers')."""
    base_ms, ms_per_token = prompt_steps.coefficients()
    decode_base, ms_per_seq = decode_steps.line() or (0.0, 0.0)
    if not prompt_steps.fitted:
        base_ms = decode_base
    return base_ms, ms_per_token, ms_per_seq


# ---- the router's view of a worker: the online fit, in milliseconds ------------------------------
@dataclass(slots=True, frozen=True)
class StepCostView:
    """A worker's step costs as the router reads them from its status (services/router/placement.py
    fills in what a worker has not learned yet): a step that computes ``n`` prompt tokens beside
    ``r`` decoding sequences costs ``base_ms + ms_per_token * n + ms_per_seq * r``."""

    base_ms: float
    ms_per_token: float
    budget: int          # tokens per step (prefill chunk)
    learned: bool        # from this worker's own steps
    ms_per_seq: float    # what one more decoding sequence adds to a step

    def decode_step_ms(self, running: int) -> float:
        """A step of running decoding sequences and no prompt tokens."""
        return self.base_ms + self.ms_per_seq * running

    def prefill_ms(self, load: "Load", uncached: int) -> float:
        """Prefilling uncached prompt tokens behind load: the prompt tokens queued ahead and these,
        in steps of ``budget`` tokens, each also carrying the sequences decoding there:

            ms_per_token * (q + u) + (base + ms_per_seq * R) * (1 + (q + u) / B)
        """
        tokens = load.queued_tokens + uncached
        return self.ms_per_token * tokens + self.decode_step_ms(load.running) * (1 + tokens / self.budget)


@dataclass(slots=True, frozen=True)
class Load:
    """What is ahead of a new prompt on a worker."""

    queued_tokens: int   # prompt tokens waiting or mid-prefill
    running: int         # sequences decoding (their tokens share every step)


# ---- the profiled model: every feature, a fit per step kind -------------------------------------
FEATURES = ("const", "prefill_tokens", "prefill_seqs", "prefill_attention", "decode_seqs", "decode_context")
KIND_FEATURES = {
    "prefill": ("const", "prefill_tokens", "prefill_seqs", "prefill_attention"),
    "decode": ("const", "decode_seqs", "decode_context"),
    "mixed": FEATURES,
}


@dataclass(slots=True)
class StepSample:
    """One measured step: what it held and how long it took (wall seconds)."""

    kind: str
    prefill_tokens: int
    prefill_seqs: int
    prefill_attention: float
    decode_seqs: int
    decode_context: float
    seconds: float              # what the fit uses: the step's CPU time (profile --clock cpu) or wall time
    wall_seconds: float = 0.0

    def features(self) -> dict[str, float]:
        return {"const": 1.0, "prefill_tokens": self.prefill_tokens, "prefill_seqs": self.prefill_seqs,
                "prefill_attention": self.prefill_attention, "decode_seqs": self.decode_seqs,
                "decode_context": self.decode_context}


def step_features(contexts: Sequence[int], counts: Sequence[int], num_decode: int, seconds: float = 0.0
                  ) -> StepSample:
    """A step of len(counts) sequences: the first num_decode decode one token each, the rest
    compute counts[i] prompt tokens after contexts[i] tokens already in the cache."""
    pt = ps = 0
    pa = dc = 0.0
    for i, (ctx, n) in enumerate(zip(contexts, counts)):
        if i < num_decode:
            dc += ctx / 1000.0
        else:
            pt += n
            ps += 1
            pa += n * (ctx + n / 2.0) / 1000.0
    kind = "mixed" if num_decode and ps else ("decode" if num_decode else "prefill")
    return StepSample(kind, pt, ps, pa, num_decode, dc, seconds)


def batch_basis(b: float, knots: Sequence[float]) -> list[float]:
    """Weights of batch size b on the piecewise-linear basis over knots (ascending): linear
    interpolation between the two knots around b, linear extrapolation beyond either end. A fit's
    coefficients on these are the step's cost at each knot."""
    w = [0.0] * len(knots)
    if len(knots) == 1:
        w[0] = b / knots[0]
        return w
    i = 0
    while i < len(knots) - 2 and b > knots[i + 1]:
        i += 1
    t = (b - knots[i]) / (knots[i + 1] - knots[i])
    w[i], w[i + 1] = 1.0 - t, t
    return w


def decode_knots(batch_sizes: Sequence[int], min_samples: int = 2, min_ratio: float = 1.15) -> list[float]:
    """The knots of the decode fit: batch sizes with at least min_samples steps, each at least
    min_ratio above the previous knot (the profile's sizes, not the size one less that a batch
    runs at after its first sequence finished)."""
    counts: dict[int, int] = {}
    for b in batch_sizes:
        counts[b] = counts.get(b, 0) + 1
    knots: list[float] = []
    for b in sorted(counts):
        if counts[b] >= min_samples and (not knots or b >= knots[-1] * min_ratio):
            knots.append(float(b))
    return knots


def fit_nonnegative(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least squares with non-negative coefficients (drop the most negative column and
    refit until none is negative: enough for a handful of features)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    w = np.sqrt(weights)[:, None]
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w, y * w[:, 0], rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


@dataclass(slots=True)
class KindFit:
    coefficients: dict[str, float]    # feature -> seconds per unit; with knots, "decode_seqs=K" -> seconds at K
    num_samples: int
    median_abs_rel_error: float
    knots: list[float] = field(default_factory=list)   # decode batch sizes of a piecewise-linear fit

    def design(self, step: StepSample) -> dict[str, float]:
        f = step.features()
        if self.knots:
            for k, w in zip(self.knots, batch_basis(step.decode_seqs, self.knots)):
                f[_knot_name(k)] = w
        return f

    def predict(self, step: StepSample) -> float:
        f = self.design(step)
        return max(0.0, sum(c * f[name] for name, c in self.coefficients.items()))

    def scaled(self, factor: float) -> "KindFit":
        """The same fit, every cost times factor."""
        return KindFit({n: c * factor for n, c in self.coefficients.items()}, self.num_samples,
                       self.median_abs_rel_error, list(self.knots))


def _knot_name(k: float) -> str:
    return f"decode_seqs={k:g}"


@dataclass(slots=True)
class StepCostModel:
    """Step time (seconds) of one engine configuration on one machine, a fit per step kind (see
    the module docstring); a kind without a fit of its own is priced by the mixed fit."""

    fits: dict[str, KindFit]

    def step_seconds(self, step: StepSample) -> float:
        return (self.fits.get(step.kind) or self.fits["mixed"]).predict(step)

    def scaled_fits(self, factor: float) -> dict[str, KindFit]:
        return {k: v.scaled(factor) for k, v in self.fits.items()}

    @staticmethod
    def fit_kinds(samples: Sequence[StepSample]) -> dict[str, KindFit]:
        """A fit per kind of the measured steps (ValueError: none). A kind with too few steps for
        its features has no fit (the mixed fit, which then takes every step, prices it)."""
        if not samples:
            raise ValueError("no step samples to fit")
        fits: dict[str, KindFit] = {}
        for kind in ("mixed", "prefill", "decode"):   # mixed first: the fallback of a kind with few samples
            names = KIND_FEATURES[kind]
            mine = [s for s in samples if s.kind == kind]
            knots: list[float] = []
            if kind == "decode":
                knots = decode_knots([s.decode_seqs for s in mine])
                if len(knots) >= 2:   # piecewise linear in the batch size, a knot per profiled size
                    names = (*(_knot_name(k) for k in knots), "decode_context")
                else:
                    knots = []
            if len(mine) < len(names) + 2:
                if kind == "mixed":
                    mine = list(samples)
                else:
                    continue
            fits[kind] = _fit_kind(mine, names, knots)
        return fits


def _fit_kind(samples: Iterable[StepSample], names: Sequence[str], knots: Sequence[float] = ()) -> KindFit:
    rows = list(samples)
    shape = KindFit({}, 0, 0.0, list(knots))
    x = np.array([[shape.design(s)[n] for n in names] for s in rows], dtype=np.float64)
    y = np.array([s.seconds for s in rows], dtype=np.float64)
    weights = 1.0 / np.maximum(y, 1e-4) ** 2          # relative error: small steps count as much as big ones
    coef = fit_nonnegative(x, y, weights)
    rel = np.abs(x @ coef - y) / np.maximum(y, 1e-4)
    keep = rel <= max(3.0 * float(np.median(rel)), 0.05)   # a step slowed by another process is an outlier
    if keep.sum() >= len(names) + 1 and not keep.all():
        coef = fit_nonnegative(x[keep], y[keep], weights[keep])
        rel = np.abs(x @ coef - y) / np.maximum(y, 1e-4)
    return KindFit({n: float(c) for n, c in zip(names, coef)}, len(rows), float(np.median(rel)), list(knots))
