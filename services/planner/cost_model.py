"""What one engine step costs on this machine: fitted from measured steps, saved as JSON.

A step's cost depends on what it holds. ``step_features`` turns a step (prefill chunks with
their context, decode sequences with theirs) into a few counts; ``CostModel`` predicts the
step's seconds as a non-negative linear function of them, one fit per step kind (prefill only,
decode only, mixed), since the CPU backend runs pure decode steps through a different path:

    t = c0 + c_pt * prefill_tokens + c_ps * prefill_seqs + c_pa * prefill_attention
          + c_ds * decode_seqs + c_dc * decode_context

prefill_attention = sum over chunks of n * (context + n / 2) / 1000 (causal attention work),
decode_context = sum of the decode sequences' context lengths / 1000 (KV read per step).
A decode-only step's cost is not linear in its batch size: the GEMMs change kernels with the row
count (the bf16-weight kernel up to 32 rows on AVX2, AMX tiles up to 64, oneDNN beyond), so
its fit is piecewise linear in decode_seqs, with knots at the profiled batch sizes (a basis of
interpolation weights, ``batch_basis``), plus c_dc * decode_context.
The profile JSON (``pdserve profile``) holds the coefficients, the raw samples they were
fitted on, the serving costs around the engine (``serving_costs``), the engine settings, the
model's config and this machine's CPU.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from pdserve.services.planner.serving_costs import ServingCosts

FEATURES = ("const", "prefill_tokens", "prefill_seqs", "prefill_attention", "decode_seqs", "decode_context")
KIND_FEATURES = {
    "prefill": ("const", "prefill_tokens", "prefill_seqs", "prefill_attention"),
    "decode": ("const", "decode_seqs", "decode_context"),
    "mixed": FEATURES,
}
FORMAT_VERSION = 2


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

    def design(self, step: "StepSample") -> dict[str, float]:
        f = step.features()
        if self.knots:
            for k, w in zip(self.knots, batch_basis(step.decode_seqs, self.knots)):
                f[_knot_name(k)] = w
        return f

    def predict(self, step: "StepSample") -> float:
        f = self.design(step)
        return max(0.0, sum(c * f[name] for name, c in self.coefficients.items()))


def _knot_name(k: float) -> str:
    return f"decode_seqs={k:g}"


@dataclass(slots=True)
class CostModel:
    """Step-time model of one engine configuration on one machine (see the module docstring)."""

    fits: dict[str, KindFit]
    kv_transfer_s_per_block: float = 0.0    # shipping one KV block prefill -> decode worker
    export_s_per_block: float = 0.0         # prefill worker: copying a finished block out of the pool
    kv_bytes_per_block: int = 0
    serving: ServingCosts = field(default_factory=ServingCosts)  # CPU around the engine while serving
    engine: dict[str, Any] = field(default_factory=dict)        # the profiled EngineConfig's fields
    model_config: dict[str, Any] = field(default_factory=dict)  # the checkpoint's config.json
    machine: dict[str, Any] = field(default_factory=dict)
    samples: list[StepSample] = field(default_factory=list)

    def step_seconds(self, step: StepSample) -> float:
        return (self.fits.get(step.kind) or self.fits["mixed"]).predict(step)

    def scaled(self, factor: float) -> "CostModel":
        """The same machine, every cost times factor (what-if; tests: a faster machine)."""
        fits = {k: KindFit({n: c * factor for n, c in v.coefficients.items()}, v.num_samples, v.median_abs_rel_error,
                           list(v.knots)) for k, v in self.fits.items()}
        sv = self.serving
        serving = ServingCosts(
            worker_s_per_token=sv.worker_s_per_token * factor,
            decode_s_per_block_received=sv.decode_s_per_block_received * factor,
            decode_s_per_request=sv.decode_s_per_request * factor,
            prefill_s_per_block_sent=sv.prefill_s_per_block_sent * factor,
            prefill_s_per_request=sv.prefill_s_per_request * factor,
            router_s_per_token={k: v * factor for k, v in sv.router_s_per_token.items()}, measured=dict(sv.measured))
        return CostModel(fits, self.kv_transfer_s_per_block * factor, self.export_s_per_block * factor,
                         self.kv_bytes_per_block, serving, dict(self.engine), dict(self.model_config),
                         dict(self.machine), list(self.samples))

    # ---- fitting ------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Sequence[StepSample], **kwargs: Any) -> "CostModel":
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
        return cls(fits, samples=list(samples), **kwargs)

    # ---- JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "features": list(FEATURES),
                "fits": {k: asdict(v) for k, v in self.fits.items()},
                "kv_transfer_s_per_block": self.kv_transfer_s_per_block,
                "export_s_per_block": self.export_s_per_block, "kv_bytes_per_block": self.kv_bytes_per_block,
                "serving": self.serving.to_json(), "engine": self.engine, "model_config": self.model_config, "machine": self.machine,
                "samples": [asdict(s) for s in self.samples]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "CostModel":
        if obj.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"profile format {obj.get('format_version')!r} is not {FORMAT_VERSION}: run "
                             f"`pdserve profile` again")
        return cls({k: KindFit(**v) for k, v in obj["fits"].items()}, obj.get("kv_transfer_s_per_block", 0.0),
                   obj.get("export_s_per_block", 0.0), obj.get("kv_bytes_per_block", 0),
                   ServingCosts.from_json(obj.get("serving")), obj.get("engine", {}),
                   obj.get("model_config", {}), obj.get("machine", {}),
                   [StepSample(**s) for s in obj.get("samples", [])])

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no profile at {path}: make one with `pdserve profile --model DIR --out {path}`")
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a pdserve profile: {exc}") from None

    def describe(self) -> str:
        lines = []
        for kind, fit in self.fits.items():
            terms = ", ".join(f"{n} {c * 1e3:.4g}" for n, c in fit.coefficients.items() if c)
            lines.append(f"  {kind:7s} ({fit.num_samples} steps, median error {fit.median_abs_rel_error:.0%}): "
                         f"ms = {terms}")
        lines.append(f"  KV transfer {self.kv_transfer_s_per_block * 1e3:.3f} ms/block, export "
                     f"{self.export_s_per_block * 1e3:.3f} ms/block ({self.kv_bytes_per_block} bytes/block)")
        lines.append(self.serving.describe())
        return "\n".join(lines)


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
