"""The router's admission queue: requests wait here, in arrival order, for decode capacity.

Only the request at the head of the queue looks for capacity, and only when a worker's status
changes (the pool's status streams wake it); the others wait on an event. Waiting therefore
costs no CPU and sends no RPCs. A full queue refuses at once with a retry hint.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import AsyncIterator

from services.router.errors import RouterError

RATE_WINDOW_S = 30.0


class AdmissionQueue:
    def __init__(self, max_waiting: int, rate_window_s: float = RATE_WINDOW_S) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self.rate_window_s = rate_window_s
        self._queue: collections.deque[asyncio.Event] = collections.deque()
        self._admitted: collections.deque[float] = collections.deque()   # recent admission times

    def __len__(self) -> int:
        return len(self._queue)

    def _prune(self, now: float) -> None:
        while self._admitted and now - self._admitted[0] > self.rate_window_s:
            self._admitted.popleft()

    def retry_after_s(self) -> float:
        """How long a refused caller should wait: the queue's length over the recent admission rate."""
        self._prune(time.monotonic())
        rate = len(self._admitted) / self.rate_window_s
        return min(60.0, max(1.0, len(self._queue) / rate if rate else 5.0))

    def full_error(self) -> RouterError:
        return RouterError("RESOURCE_EXHAUSTED",
                           f"admission queue is full ({self.max_waiting} requests waiting for decode capacity); "
                           f"retry later", retry_after_s=self.retry_after_s())

    @contextlib.asynccontextmanager
    async def turn(self, timeout: float) -> AsyncIterator[None]:
        """Wait (up to timeout) to be the head of the queue; the block runs as the head."""
        if len(self._queue) >= self.max_waiting + 1:   # the head is not waiting, the others are
            raise self.full_error()
        me = asyncio.Event()
        if not self._queue:
            me.set()
        self._queue.append(me)
        try:
            try:
                await asyncio.wait_for(me.wait(), timeout)
            except asyncio.TimeoutError:
                raise RouterError("RESOURCE_EXHAUSTED", f"no decode capacity within {timeout:g}s "
                                  f"({len(self._queue) - 1} requests ahead)", retry_after_s=self.retry_after_s()) from None
            yield
            now = time.monotonic()
            self._prune(now)   # at every admission: the record holds the last window, never more
            self._admitted.append(now)
        finally:
            was_head = bool(self._queue) and self._queue[0] is me
            self._queue.remove(me)
            if was_head and self._queue:
                self._queue[0].set()


class PendingGate:
    """Requests between arrival and the admission queue (body being read, parsed, tokenized),
    over every front door together. Past the cap one more is refused at once, so a flood of
    requests (or of slow bodies) holds a bounded amount of memory and tokenizer work."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {limit}")
        self.limit = limit
        self.count = 0

    @contextlib.contextmanager
    def hold(self):
        if self.count >= self.limit:
            raise RouterError("RESOURCE_EXHAUSTED", f"{self.count} requests are being received and tokenized "
                              f"(max_pending_requests={self.limit}); retry later", retry_after_s=1.0)
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
