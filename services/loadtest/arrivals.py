"""When each request of a load test is sent: gamma-distributed gaps (Poisson at burstiness 1)."""
from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds after the start): gamma-distributed gaps with mean 1/rate and shape
    burstiness (1 = Poisson), the first request at 0; every request at 0 for rate inf."""
    if rate == math.inf:
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    theta = 1.0 / (rate * burstiness)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=theta, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]

