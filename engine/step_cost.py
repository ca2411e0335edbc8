"""What a step costs on this worker, learned online from its own steps.

A step's wall time is fitted as ``base_ms + ms_per_token * tokens``, where tokens counts every
token the step computes (a prefill chunk's tokens, one per decode). Both roles see varied
steps (prefill chunks of different sizes; decode batches that grow and shrink), so both
coefficients are identifiable; the fit is a least-squares line over exponentially decayed
sums, so it follows a machine that gets slower or faster within ~``1 / (1 - decay)`` steps.

Decode-only steps are fitted on their own, by sequences (``decode_step_cost`` of the engine),
and only steps that compute prompt tokens are fitted by tokens (``step_cost``): a decode step's
cost is mostly its fixed part (the weights are read once for the whole batch), so one more
running sequence adds that fit's slope to every step, and a decode worker that has only decoded
knows nothing of what a prompt token costs it (fitting its decode steps by tokens, through the
origin, prices a prompt token at a whole step per sequence, 5-10x too high).

The router turns these into the costs it routes by (services/router/cost_model.py): how long a
prompt takes to prefill here, and how much a prompt chunk adds to the steps of the
sequences decoding here (the inter-token latency inflation of a local prefill).
"""
from __future__ import annotations

from dataclasses import dataclass

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
