"""The router's picture of which prefix blocks each worker holds (KV-aware routing).

Fed by the worker's ``WatchKVEvents`` stream (keys of blocks computed there, moved to a KV tier
under its pool, and removed, engine/kv/events.py) and by the router itself: a request routed to a worker will leave its
prompt's blocks there, so its keys are noted at once (``note_routed``), before the worker
reports them, and a burst of requests sharing a prefix follows the first one. Until the
worker reports them computed they are *pending*: a request that reaches the worker before
then finds blocks still being computed or received, which it cannot share (the router may wait
for them: ``pending_blocks``). ``settle`` ends the wait when the request that noted them has
its KV in place, or is gone, whatever the worker reported.

Bounded: at most ``max_keys`` keys per worker, the least recently touched dropped first.
Nothing here can produce a wrong token: a key the worker no longer holds (dropped event,
stale note, lost stream) only makes the router expect a hit the worker then misses.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from pdserve.engine.kv.block_manager import prompt_block_hashes, salt_root
from pdserve.services.router.config import DEFAULT_MAX_KEYS



class PrefixIndex:
    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._keys: OrderedDict[int, bool] = OrderedDict()   # key -> in a KV tier only (a load away)
        self._pending: set[int] = set()   # noted as routed here, not reported computed yet

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def clear(self) -> None:
        self._keys.clear()
        self._pending.clear()

    def apply(self, reset: bool, stored: Iterable[int], removed: Iterable[int], tiered: Iterable[int] = ()) -> None:
        """One KVEvents message."""
        if reset:
            self.clear()
        for key in removed:
            self._keys.pop(key, None)
            self._pending.discard(key)
        stored = list(stored)
        self._pending.difference_update(stored)
        self._add(stored)
        self._add(tiered, tiered=True)

    def note_routed(self, keys: Iterable[int]) -> None:
        """A request with these block keys was just sent here: they will be held soon."""
        keys = list(keys)
        self._pending.update(k for k in keys if k not in self._keys)
        self._add(keys)

    def settle(self, keys: Iterable[int]) -> None:
        """The request that noted these keys has its KV in place here, or is gone: stop expecting
        the worker to report them (whatever it reported, the index keeps)."""
        self._pending.difference_update(keys)

    def _add(self, keys: Iterable[int], tiered: bool = False) -> None:
        for key in keys:
            self._keys[key] = tiered
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            key, _ = self._keys.popitem(last=False)
            self._pending.discard(key)

    def matched_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chain keys, in order) this worker holds."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def tiered_blocks(self, keys: Sequence[int]) -> int:
        """How many of a prompt's leading blocks held here (matched_blocks) are in a KV tier only."""
        n = 0
        for key in keys:
            tiered = self._keys.get(key)
            if tiered is None:
                break
            n += tiered
        return n

    def pending_blocks(self, keys: Sequence[int]) -> int:
        """How many of a prompt's leading blocks held here (matched_blocks) are still pending."""
        if not self._pending:
            return 0
        return sum(1 for key in keys[:self.matched_blocks(keys)] if key in self._pending)


def request_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Chain keys of a request's full blocks, as the workers' prefix caches compute them."""
    return prompt_block_hashes(list(token_ids), block_size, salt_root(cache_salt))
