"""Prefix-cache key changes, for publishing to routers (KV-aware routing).

The block manager reports every key it holds computed (``stored``), every key whose block left
the pool for a KV tier (``tiered``: host RAM or disk hold it, a load rather than a recompute;
engine/kv/tiers.py), and every key it drops (``removed``: the block was reused or freed
uncomputed, or a tier dropped it). The log is a bounded window of those
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
    reset: bool = False                                # stored and tiered are every key now held
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    tiered: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.reset or bool(self.stored or self.removed or self.tiered)


REMOVED, STORED, TIERED = 0, 1, 2


class KVEventLog:
    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._events: deque[tuple[int, int]] = deque(maxlen=window)   # (key, REMOVED | STORED | TIERED)
        self._end = 0            # sequence number of the next event

    @property
    def cursor(self) -> int:
        return self._end

    def _append(self, key: int, state: int) -> None:
        self._events.append((key, state))
        self._end += 1

    def stored(self, key: int) -> None:
        self._append(key, STORED)

    def tiered(self, key: int) -> None:
        self._append(key, TIERED)

    def removed(self, key: int) -> None:
        self._append(key, REMOVED)

    def read(self, cursor: int | None, snapshot: Callable[[], Iterable[int]],
             tiered_snapshot: Callable[[], Iterable[int]] = tuple) -> KVEventBatch:
        """Net changes after cursor (a key stored then removed in the window is just removed).
        cursor None, or older than the window: a snapshot of every key (snapshot(): in the pool;
        tiered_snapshot(): in a tier only)."""
        start = self._end - len(self._events)
        if cursor is None or cursor < start or cursor > self._end:
            stored = list(snapshot())
            held = set(stored)
            return KVEventBatch(self._end, reset=True, stored=stored,
                                tiered=[k for k in tiered_snapshot() if k not in held])
        net: dict[int, int] = {}
        for key, state in islice(self._events, cursor - start, None):
            net[key] = state
        return KVEventBatch(self._end, stored=[k for k, s in net.items() if s == STORED],
                            removed=[k for k, s in net.items() if s == REMOVED],
                            tiered=[k for k, s in net.items() if s == TIERED])
