"""What a request was promised, and whether the router can still keep it.

A request's ``ServiceClass``: its priority (lower first, as vLLM's ``priority``; its API key's
grant bounds it, services/api/principals.py), its principal (the API key's name: the fair-share
key inside a priority, so a client cannot split itself into many), OpenAI's ``user``, its latency
targets (TTFT and TPOT in ms; unset: the deployment's ``--slo-ttft-ms`` / ``--slo-tpot-ms``, and
never tighter than those), and its session (``session_id``, else ``user``, inside its principal;
services/router/routes.py, SessionTable).

With ``--slo-admission`` the router admits by prediction (``SloPolicy``):

- at arrival it predicts the request's TTFT: the wait in the admission queue (the requests
  ahead of it in its order, at the recent admission rate) plus the best route's estimate (the
  prefill worker's queue and compute, the KV transfer; services/router/placement.py). A request
  predicted to miss its TTFT target is refused at once (RESOURCE_EXHAUSTED / HTTP 429) with a
  retry hint of the predicted excess, never queued to miss it;
- a request whose TPOT target is below every decode worker's step time with nothing else
  running there is refused at arrival (INVALID_ARGUMENT naming ``slo_tpot_ms`` and that time):
  no wait would ever place it;
- a decode worker is offered a request only while its predicted step time with one more
  sequence stays within the tightest TPOT target of that request and of those already decoding
  there, so admitted work is not pushed past its targets (the request waits in the queue). A
  queue head that no worker takes only because of its own TPOT target steps aside until the
  workers' state changes, so the requests behind it are placed meanwhile (AdmissionQueue);
- a request still waiting when its TTFT target has passed is shed (RESOURCE_EXHAUSTED, saying
  so) rather than served late, unless ``--no-slo-shed``.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from pdserve.engine.quoting import quoted
from pdserve.engine.sampling_params import PRIORITY_RANGE
from pdserve.services.router.admission import Ticket

MAX_CLIENT_CHARS = 256
MAX_TARGET_MS = 3_600_000.0
MIN_RETRY_AFTER_S = 0.1
MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class ServiceClass:
    priority: int = 0
    client: str = ""                  # OpenAI's `user`, as the client sent it
    ttft_ms: float | None = None      # None: the deployment's target (if any)
    tpot_ms: float | None = None
    session: str = ""                 # session_id; empty: the client's, if any
    principal: str = ""               # who the API key says sent it ("": the open API's anonymous caller)

    def __post_init__(self) -> None:
        check_service_class(self.priority, self.client, self.ttft_ms, self.tpot_ms, self.session)

    @property
    def ticket(self) -> Ticket:
        """The admission queue's view: the fair share is the principal's, not the `user` it sends."""
        return Ticket(self.priority, self.principal)

    @property
    def session_key(self) -> str:
        """The multi-turn session the request belongs to ("" : none), inside its principal."""
        name = self.session or self.client
        return f"{self.principal}\x1f{name}" if name and self.principal else name


def check_service_class(priority: int, client: str, ttft_ms: float | None, tpot_ms: float | None,
                        session: str = "") -> None:
    """ValueError naming the field and its limit (the doors map it to INVALID_ARGUMENT / 400)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise ValueError(f"priority must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], got {quoted(priority)}")
    if not isinstance(client, str) or len(client) > MAX_CLIENT_CHARS:
        raise ValueError(f"user must be a string of at most {MAX_CLIENT_CHARS} characters")
    if not isinstance(session, str) or len(session) > MAX_CLIENT_CHARS:
        raise ValueError(f"session_id must be a string of at most {MAX_CLIENT_CHARS} characters")
    for name, value in (("slo_ttft_ms", ttft_ms), ("slo_tpot_ms", tpot_ms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= MAX_TARGET_MS):
            raise ValueError(f"{name} must be a number of milliseconds in (0, {MAX_TARGET_MS:g}], got {quoted(value)}")


@dataclass(frozen=True, slots=True)
class SloPolicy:
    """The deployment's targets and whether the router admits by prediction."""

    admission: bool = False
    ttft_ms: float = 0.0     # 0: none
    tpot_ms: float = 0.0
    shed_late: bool = True

    def ttft_target_ms(self, service: ServiceClass) -> float | None:
        """The request's TTFT target: its own, never tighter than the deployment's."""
        return max(service.ttft_ms or 0.0, self.ttft_ms) or None

    def tpot_target_ms(self, service: ServiceClass) -> float | None:
        """The request's TPOT target: its own, never tighter than the deployment's."""
        return max(service.tpot_ms or 0.0, self.tpot_ms) or None


class OverloadShares:
    """Who yields while the deployment is overloaded (a request was refused in the last
    ``window_s``): a request of a class below one refused meanwhile yields to it, and inside a
    class a client already admitted more than its fair share (the class's admissions over its
    active clients) yields to the others. Prediction alone refuses whoever arrives when capacity
    is short, in proportion to sending rates; this keeps the capacity there is for the higher
    classes and the clients under their share."""

    def __init__(self, window_s: float = 10.0, overload_s: float = 1.0) -> None:
        self.window_s, self.overload_s = window_s, overload_s
        self._admitted: collections.deque[tuple[float, int, str]] = collections.deque()
        # priority -> when one of it was last refused, oldest first; only the last overload_s kept
        self._refused_at: dict[int, float] = {}

    def _prune(self, now: float) -> None:
        while self._admitted and now - self._admitted[0][0] > self.window_s:
            self._admitted.popleft()

    def refused(self, ticket: Ticket, now: float) -> None:
        self._refused_at.pop(ticket.priority, None)   # re-inserted last: the dict stays in time order
        self._refused_at[ticket.priority] = now
        self._forget_refusals(now)

    def _forget_refusals(self, now: float) -> None:
        """Drop refusals older than overload_s: the record holds at most the classes refused
        within it, however many distinct priorities clients send."""
        while self._refused_at:
            priority, at = next(iter(self._refused_at.items()))
            if now - at <= self.overload_s:
                break
            del self._refused_at[priority]

    def admitted(self, ticket: Ticket, now: float) -> None:
        self._prune(now)
        self._admitted.append((now, ticket.priority, ticket.client))

    def yields(self, ticket: Ticket, now: float) -> str | None:
        """Why ticket yields now (None: it need not)."""
        self._forget_refusals(now)
        recent = self._refused_at.keys()
        if not recent:
            return None
        if any(p < ticket.priority for p in recent):
            return "a higher priority class is being refused: this one yields to it"
        self._prune(now)
        mine = [c for _, p, c in self._admitted if p == ticket.priority]
        clients = set(mine) | {ticket.client}
        if len(clients) > 1 and mine.count(ticket.client) > len(mine) / len(clients):
            return "its client has more than its fair share of this class while the deployment is overloaded"
        return None


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
