"""Multi-turn sessions: which decode worker holds a conversation's KV.

A request's session key is its ``session_id`` (gRPC field, HTTP extension), else its OpenAI
``user``. When a turn finishes on a decode (or colocated) worker, that worker holds the whole
turn in its prefix cache — the history, the new message and the answer it generated — so the
next turn's prompt (history + answer + new message) is cached there up to its new tokens. The
table remembers the worker for ``session_ttl_s`` after the turn; the next turn's placement
(services/router/placement.py) may then prefill on that worker, computing only what it lacks,
wherever the cost model finds that cheaper than a prefill worker recomputing the history, even
under ``--disaggregation always``. Bounded: at most ``max_sessions`` entries, least recently
used dropped first.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable


class SessionTable:
    def __init__(self, ttl_s: float, max_sessions: int, clock: Callable[[], float] = time.monotonic) -> None:
        """ttl_s 0: sessions off (nothing is remembered)."""
        if ttl_s < 0:
            raise ValueError(f"session_ttl_s must be >= 0, got {ttl_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._workers: OrderedDict[str, tuple[str, float]] = OrderedDict()   # key -> (address, expires)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        return len(self._workers)

    def worker(self, key: str) -> str | None:
        """The address of the worker that served the session's last turn, within its TTL."""
        if not key or not self.enabled:
            return None
        entry = self._workers.get(key)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            del self._workers[key]
            return None
        return entry[0]

    def turn_ended(self, key: str, address: str) -> None:
        """A turn of the session finished on the worker at address: its KV is there now."""
        if not key or not self.enabled:
            return
        self._workers[key] = (address, self.clock() + self.ttl_s)
        self._workers.move_to_end(key)
        while len(self._workers) > self.max_sessions:
            self._workers.popitem(last=False)
