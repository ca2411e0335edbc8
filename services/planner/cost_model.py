"""A profile: what one engine step costs on this machine, and what serving costs around it,
fitted from measured steps (``pdserve profile``), saved as JSON.

The step costs are the one step-cost model (engine/step_cost.py: ``step_features`` of a step,
a non-negative linear fit per step kind, decode piecewise linear in the batch size);
``CostModel`` is that model with the rest of a profile: the KV hand-off's costs per block, the
serving costs around the engine (``serving_costs``), the engine settings, the model's config and
this machine's CPU. The JSON holds the coefficients, the raw samples they were fitted on and all
of these.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pdserve.engine.step_cost import FEATURES, KindFit, StepCostModel, StepSample
from pdserve.services.planner.serving_costs import ServingCosts

__all__ = ["CostModel", "FORMAT_VERSION"]

FORMAT_VERSION = 2


@dataclass(slots=True)
class CostModel(StepCostModel):
    """A profile: the step-time model (``fits``, ``step_seconds``) of one engine configuration on
    one machine, with the costs around the steps (see the module docstring)."""

    kv_transfer_s_per_block: float = 0.0    # shipping one KV block prefill -> decode worker
    export_s_per_block: float = 0.0         # prefill worker: copying a finished block out of the pool
    kv_bytes_per_block: int = 0
    serving: ServingCosts = field(default_factory=ServingCosts)  # CPU around the engine while serving
    engine: dict[str, Any] = field(default_factory=dict)        # the profiled EngineConfig's fields
    model_config: dict[str, Any] = field(default_factory=dict)  # the checkpoint's config.json
    machine: dict[str, Any] = field(default_factory=dict)
    samples: list[StepSample] = field(default_factory=list)

    def scaled(self, factor: float) -> "CostModel":
        """The same machine, every cost times factor (what-if; tests: a faster machine)."""
        fits = self.scaled_fits(factor)
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
        return cls(cls.fit_kinds(samples), samples=list(samples), **kwargs)

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

