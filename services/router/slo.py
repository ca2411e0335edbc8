"""What a request was promised, and whether the router can still keep it.

A request's ``ServiceClass``: its priority (lower first, as vLLM's ``priority``), its client (the
fair-share key inside a priority: OpenAI's ``user``), and its latency targets (TTFT and TPOT in
ms; unset: the deployment's ``--slo-ttft-ms`` / ``--slo-tpot-ms``).

With ``--slo-admission`` the router admits by prediction (``SloPolicy``):

- at arrival it predicts the request's TTFT: the wait in the admission queue (the requests
  ahead of it in its order, at the recent admission rate) plus the best route's estimate (the
  prefill worker's queue and compute, the KV transfer; services/router/cost_model.py). A request
  predicted to miss its TTFT target is refused at once (RESOURCE_EXHAUSTED / HTTP 429) with a
  retry hint of the predicted excess, never queued to miss it;
- a decode worker is offered a request only while its predicted step time with one more
  sequence stays within the tightest TPOT target of that request and of those already decoding
  there, so admitted work is not pushed past its targets (the request waits in the queue);
- a request still waiting when its TTFT target has passed is shed (RESOURCE_EXHAUSTED, saying
  so) rather than served late, unless ``--no-slo-shed``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.router.admission import Ticket

MAX_CLIENT_CHARS = 256
MAX_TARGET_MS = 3_600_000.0
PRIORITY_RANGE = (-(2 ** 31), 2 ** 31 - 1)
MIN_RETRY_AFTER_S = 0.1
MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class ServiceClass:
    priority: int = 0
    client: str = ""
    ttft_ms: float | None = None      # None: the deployment's target (if any)
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        check_service_class(self.priority, self.client, self.ttft_ms, self.tpot_ms)

    @property
    def ticket(self) -> Ticket:
        return Ticket(self.priority, self.client)


def check_service_class(priority: int, client: str, ttft_ms: float | None, tpot_ms: float | None) -> None:
    """ValueError naming the field and its limit (the doors map it to INVALID_ARGUMENT / 400)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise ValueError(f"priority must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], got {priority!r}")
    if not isinstance(client, str) or len(client) > MAX_CLIENT_CHARS:
        raise ValueError(f"user must be a string of at most {MAX_CLIENT_CHARS} characters")
    for name, value in (("slo_ttft_ms", ttft_ms), ("slo_tpot_ms", tpot_ms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= MAX_TARGET_MS):
            raise ValueError(f"{name} must be a number of milliseconds in (0, {MAX_TARGET_MS:g}], got {value!r}")


@dataclass(frozen=True, slots=True)
class SloPolicy:
    """The deployment's targets and whether the router admits by prediction."""

    admission: bool = False
    ttft_ms: float = 0.0     # 0: none
    tpot_ms: float = 0.0
    shed_late: bool = True

    def ttft_target_ms(self, service: ServiceClass) -> float | None:
        return service.ttft_ms or self.ttft_ms or None

    def tpot_target_ms(self, service: ServiceClass) -> float | None:
        return service.tpot_ms or self.tpot_ms or None


def predicted_wait_ms(ahead: int, admissions_per_s: float) -> float:
    """The wait in the admission queue behind ahead requests, at the recent admission rate (0 when
    nothing is ahead; unknown, so 0, before any admission was seen)."""
    if ahead <= 0 or admissions_per_s <= 0:
        return 0.0
    return ahead / admissions_per_s * 1e3


def retry_after_s(excess_ms: float) -> float:
    """The retry hint of a request refused for a predicted miss: about the predicted excess."""
    if not math.isfinite(excess_ms):
        return MAX_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, excess_ms / 1e3))


def step_ms_with_one_more(base_ms: float, ms_per_seq: float, running: int) -> float:
    """A decode worker's predicted step time (its TPOT) with one more sequence decoding there."""
    return base_ms + ms_per_seq * (running + 1)
