"""Prefix-cache key changes, for publishing to routers (KV-aware routing).

The block manager reports every key it holds computed (``stored``) and every key it drops
(``removed``: the block was reused or freed uncomputed). The log is a bounded window of those
events with sequence numbers, read by any number of readers, each with its own cursor: a
reader that fell out of the window (or a new one) gets a snapshot of every key instead, so
a slow reader costs memory of the window only, never of its own backlog.

A router's index built from these events can lag or lose entries; that costs a prefix-cache
miss, never a wrong token (the worker looks every block up by key and token ids itself).
"""
from __future__ import annotations

from collections import deque
from itertools import islice
from dataclasses import dataclass, field
from typing import Callable, Iterable

DEFAULT_WINDOW = 1 << 16   # events kept for readers that are behind


@dataclass(slots=True)
class KVEventBatch:
    """What a reader learns in one read: the net change since its cursor, or a snapshot."""

    cursor: int                                        # pass back to read on from here
    reset: bool = False                                # stored is every key now held; forget the rest
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.reset or bool(self.stored or self.removed)


class KVEventLog:
    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._events: deque[tuple[int, bool]] = deque(maxlen=window)   # (key, stored)
        self._end = 0            # sequence number of the next event

    @property
    def cursor(self) -> int:
        return self._end

    def stored(self, key: int) -> None:
        self._events.append((key, True))
        self._end += 1

    def removed(self, key: int) -> None:
        self._events.append((key, False))
        self._end += 1

    def read(self, cursor: int | None, snapshot: Callable[[], Iterable[int]]) -> KVEventBatch:
        """Net changes after cursor (a key stored then removed in the window is just removed).
        cursor None, or older than the window: a snapshot of every key (snapshot())."""
        start = self._end - len(self._events)
        if cursor is None or cursor < start or cursor > self._end:
            return KVEventBatch(self._end, reset=True, stored=list(snapshot()))
        net: dict[int, bool] = {}
        for key, is_stored in islice(self._events, cursor - start, None):
            net[key] = is_stored
        return KVEventBatch(self._end, stored=[k for k, s in net.items() if s],
                            removed=[k for k, s in net.items() if not s])
