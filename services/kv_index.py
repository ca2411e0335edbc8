"""The router's picture of which prefix blocks each worker holds (KV-aware routing).

Fed by the worker's ``WatchKVEvents`` stream (keys stored and removed, engine/kv_events.py)
and by the router itself: a request routed to a worker will leave its prompt's blocks there,
so its keys are noted at once (``note_routed``), before the worker reports them, and a burst
of requests sharing a prefix follows the first one.

Bounded: at most ``max_keys`` keys per worker, the least recently touched dropped first.
Nothing here can produce a wrong token: a key the worker no longer holds (dropped event,
stale note, lost stream) only makes the router expect a hit the worker then misses.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from engine.block_manager import prompt_block_hashes

DEFAULT_MAX_KEYS = 1 << 20   # per worker: ~100 MB of Python objects at most, far above a real pool's blocks


class PrefixIndex:
    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def clear(self) -> None:
        self._keys.clear()

    def apply(self, reset: bool, stored: Iterable[int], removed: Iterable[int]) -> None:
        """One KVEvents message."""
        if reset:
            self._keys.clear()
        for key in removed:
            self._keys.pop(key, None)
        self._add(stored)

    def note_routed(self, keys: Iterable[int]) -> None:
        """A request with these block keys was just sent here: they will be held soon."""
        self._add(keys)

    def _add(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def matched_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chain keys, in order) this worker holds."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n


def request_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain keys of a request's full blocks, as the workers' prefix caches compute them."""
    return prompt_block_hashes(list(token_ids), block_size)
