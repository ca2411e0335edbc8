"""Paged KV block pool with reference counts and a hash-chained prefix cache.

A full block's key is hash(parent key, its token ids). Freed blocks keep their key and
stay findable until the pool hands them out again (lazy eviction, least recently freed
first). A key lookup also compares token ids, so a hash collision can never share a block.

With KV tiers (engine/kv/tiers.py), a computed block the pool hands out again is first copied
to host RAM (and from there to disk); an allocation whose cached prefix runs out in the pool
continues it from the tiers, writing each block found into a fresh pool block.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TYPE_CHECKING

import numpy as np

from pdserve.engine.kv.events import KVEventLog
from pdserve.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

ROOT_HASH = 0


def chain_hash(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """Content address of a full block: stable across processes and machines."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def salt_root(cache_salt: str | None) -> int:
    """The parent hash of a request's first block: ROOT_HASH, or one derived from its cache salt,
    so that requests with different salts never share a block (vLLM's cache_salt: a client's
    cached_tokens reveal nothing of other clients' prompts)."""
    if not cache_salt:
        return ROOT_HASH
    h = hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"pdserve-salt")
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(token_ids: list[int], block_size: int, root: int = ROOT_HASH) -> list[int]:
    """Chain hashes of every full block of token_ids (root: salt_root of the request's salt)."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def transfer_block_hashes(token_ids: list[int], block_size: int, root: int = ROOT_HASH) -> list[int]:
    """Chain hashes of every block of token_ids, the partial last block included: the
    identity each shipped block carries, which the receiver recomputes and checks."""
    hashes = prompt_block_hashes(token_ids, block_size, root)
    tail = len(token_ids) % block_size
    if tail:
        hashes.append(chain_hash(hashes[-1] if hashes else root, token_ids[-tail:]))
    return hashes


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: int = ROOT_HASH  # the key hash was chained from (with token_ids)
    computed: bool = False   # its KV bytes are valid


class Evicted(NamedTuple):
    """A computed, keyed block the pool is handing out again: what the KV tiers copy first."""

    block_id: int
    key: int
    parent: int
    token_ids: tuple[int, ...]


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation right now."""


class TierStore(Protocol):
    """What the block manager asks of the KV tiers under its prefix cache (engine/kv/tiers.KVTiers)."""

    disk: Any

    def offload(self, victims: list[Evicted]) -> tuple[list[int], list[int]]: ...
    def write(self, block_ids: list[int], data: Any) -> None: ...
    def holds_on_disk(self, key: int) -> bool: ...
    def holds_in_host(self, key: int) -> bool: ...
    def start_load(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> Any: ...
    def fetch(self, key: int, parent: int, token_ids: tuple[int, ...]) -> Any: ...
    def keys(self) -> list[int]: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None, tiers: "TierStore | None" = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries = 0   # prompt tokens looked up
        self.prefix_cache_hits = 0      # prompt tokens found computed in the cache
        self.events = events            # keys held computed / dropped, for routers (kv_events)
        self.tiers = tiers if enable_prefix_caching else None   # host RAM / disk under the cache
        self._evicted: list[Evicted] = []   # computed blocks handed out, bytes not yet offloaded

    # ---- pool -----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> Block:
        if not self.free_ids:
            raise NoFreeBlocks("no free KV blocks")
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        offloading = self.tiers is not None and block.computed and block.hash is not None and \
            self.hash_to_block.get(block.hash) == block_id
        if offloading:   # its key is announced tiered or removed once the tiers took it or not
            self._evicted.append(Evicted(block_id, block.hash, block.parent, block.token_ids))
        self._forget_hash(block, announce=not offloading)
        block.ref_count = 1
        block.computed = False
        return block

    def _offload_evicted(self) -> None:
        """Copy the computed blocks just handed out to the tiers, before anything overwrites them."""
        if self._evicted:
            victims, self._evicted = self._evicted, []
            kept, dropped = self.tiers.offload(victims)
            if self.events is not None:
                for key in kept:
                    if key not in self.hash_to_block:   # (the pool may hold it again already)
                        self.events.tiered(key)
                for key in dropped:
                    if key not in self.hash_to_block:
                        self.events.removed(key)

    def _forget_hash(self, block: Block, announce: bool = True) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
            if self.events is not None and announce:
                self.events.removed(block.hash)
        block.hash = None
        block.token_ids = None
        block.parent = ROOT_HASH

    def _ref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free_ids[block.block_id]
        block.ref_count += 1

    def _unref(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            if not block.computed:
                self._forget_hash(block)   # garbage bytes must never be found by key
            self.free_ids[block.block_id] = None

    def _lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> Block | None:
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def _register(self, block: Block, block_hash: int, token_ids: tuple[int, ...], parent: int) -> None:
        block.hash, block.token_ids, block.parent = block_hash, token_ids, parent
        if self.enable_prefix_caching and block_hash not in self.hash_to_block:
            self.hash_to_block[block_hash] = block.block_id
            if block.computed:
                self._publish(block)

    def _publish(self, block: Block) -> None:
        """Tell routers (kv_events) a key is held: when its block is computed, not when it is
        registered, since a sequence that finds a block still being computed recomputes it."""
        if self.events is not None and block.hash is not None and \
                self.hash_to_block.get(block.hash) == block.block_id:
            self.events.stored(block.hash)

    # ---- sequences ------------------------------------------------------------
    def allocate(self, seq: Sequence, max_cached_tokens: int | None = None, *, receiving: bool = False,
                 reserve_blocks: int = 0) -> int:
        """Give seq blocks for all its tokens, sharing cached ones. Returns computed prefix tokens.

        Blocks found by key are shared even if another sequence is still computing them
        (scheduled in the same step): the caller recomputes from the first uncomputed block,
        which writes identical bytes, and no key is ever overwritten.

        Where the pool's computed prefix ends, the KV tiers (if any) continue it: each following
        block a tier holds is written into a fresh block, computed and keyed as if computed here
        (host RAM, then disk, up to the first miss; a disk read happens here, synchronously).

        receiving=True (a decode worker's reservation, whose bytes arrive from elsewhere): only
        computed blocks are shared, and the fresh ones get no key until mark_computed, so no
        other sequence can find a block whose received bytes are not verified yet (blocks from
        a tier are verified: they are keyed at once, and are not shipped).
        reserve_blocks: free blocks that must remain after this allocation (room for others).
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        bs = self.block_size
        root = salt_root(seq.params.cache_salt)
        hashes = prompt_block_hashes(seq.token_ids, bs, root) if self.enable_prefix_caching else []
        n_full = len(hashes)
        # Blocks we will share: leading prefix found by key. Count fresh ones before touching state.
        shared: list[Block] = []
        for i, h in enumerate(hashes):
            block = self._lookup(h, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if block is None or (receiving and not block.computed):
                break
            shared.append(block)
        fresh_needed = self.blocks_needed(seq.num_tokens) - len(shared)
        fresh_available = self.num_free_blocks - sum(1 for b in shared if b.ref_count == 0) - reserve_blocks
        if fresh_needed > fresh_available:
            raise NoFreeBlocks(f"need {fresh_needed} blocks, {max(0, fresh_available)} free")
        computed_prefix = 0
        for i, block in enumerate(shared):
            self._ref(block)
            seq.block_table.append(block.block_id)
            if block.computed and computed_prefix == i:
                computed_prefix = i + 1
        limit = seq.num_tokens - 1 if max_cached_tokens is None else max_cached_tokens
        loaded = self._fetch(seq, hashes, root, len(shared), min(limit // bs, n_full)) \
            if computed_prefix == len(shared) else []
        # The fresh blocks (the least recently freed) in ascending id order: a freed sequence's
        # blocks come back tail first, so they would come out descending, and every block would
        # be its own copy where the pool is written or read a run at a time (KV hand-off).
        fresh = sorted((self._take_free() for _ in range(fresh_needed)), key=lambda b: b.block_id)
        self._offload_evicted()   # their old bytes leave before tier blocks or a step overwrite them
        if loaded:
            self.tiers.write([b.block_id for b in fresh[:len(loaded)]], loaded)
            computed_prefix += len(loaded)
        keyed = len(shared) + len(loaded) if receiving else n_full
        for i, block in enumerate(fresh, start=len(shared)):
            if i < keyed:
                block.computed = i < len(shared) + len(loaded)
                self._register(block, hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]),
                               hashes[i - 1] if i else root)
            seq.block_table.append(block.block_id)
        # A receiving sequence's keys are (re)computed by mark_computed once its bytes are verified.
        seq.block_hashes = hashes[:keyed]
        seq.num_hashed_blocks = len(seq.block_hashes)
        cached = computed_prefix * bs
        cached = min(cached, (limit // bs) * bs)   # always compute at least the last token
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += cached
        return cached

    def ready(self, seq: Sequence) -> bool:
        """False while seq's prefix blocks are read from the disk KV tier in the background: the
        read starts here, the first time the scheduler asks, for the blocks after the pool's
        computed prefix that only the disk tier holds; meanwhile other sequences are admitted."""
        tiers = self.tiers
        if seq.tier_load is True or tiers is None or tiers.disk is None:
            return True
        if seq.tier_load is not None:
            if not seq.tier_load.done():
                return False
            seq.tier_load = True
            return True
        seq.tier_load = True
        bs = self.block_size
        root = salt_root(seq.params.cache_salt)
        hashes = prompt_block_hashes(seq.token_ids, bs, root)
        stop = min((seq.num_tokens - 1) // bs, len(hashes))   # as allocate: at least one token is computed
        tokens = lambda i: tuple(seq.token_ids[i * bs:(i + 1) * bs])   # noqa: E731
        i = 0
        while i < stop and (block := self._lookup(hashes[i], tokens(i))) is not None and block.computed:
            i += 1
        wanted = []
        for j in range(i, stop):
            if tiers.holds_on_disk(hashes[j]):
                wanted.append((hashes[j], hashes[j - 1] if j else root, tokens(j)))
            elif not tiers.holds_in_host(hashes[j]):
                break   # the chain ends here
        if not wanted:
            return True
        seq.tier_load = tiers.start_load(wanted)
        return False

    def _fetch(self, seq: Sequence, hashes: list[int], root: int, start: int, stop: int) -> list["torch.Tensor"]:
        """The bytes of seq's blocks start, start+1, ... (before stop) the tiers hold, up to the first miss."""
        found: list["torch.Tensor"] = []
        if self.tiers is None:
            return found
        bs = self.block_size
        for i in range(start, stop):
            parent = hashes[i - 1] if i else root
            data = self.tiers.fetch(hashes[i], parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if data is None:
                break
            found.append(data)
        return found

    def free(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail is evicted before its (more shareable) head.
        for block_id in reversed(seq.block_table):
            self._unref(self.blocks[block_id])
        seq.block_table.clear()
        seq.num_hashed_blocks = 0
        seq.block_hashes = []

    def append_slot(self, seq: Sequence) -> None:
        """Make sure seq has a block for its last token (before a decode step)."""
        try:
            while len(seq.block_table) * self.block_size < seq.num_tokens:
                seq.block_table.append(self._take_free().block_id)
        finally:
            self._offload_evicted()

    def append_lookahead(self, seq: Sequence, num_slots: int, keep_free: int = 0) -> int:
        """Blocks for up to num_slots slots past seq's tokens (a speculative draft verified in the
        next step), taken only while more than keep_free blocks stay free; returns how many such
        slots seq now has (at most num_slots). They hold unverified tokens' KV: never keyed, never
        marked computed (mark_computed stops at num_computed_tokens, which counts accepted tokens
        only), and trim gives them back once the step's results are applied."""
        bs = self.block_size
        wanted = self.blocks_needed(seq.num_tokens + num_slots) - len(seq.block_table)
        try:
            for _ in range(max(0, min(wanted, self.num_free_blocks - keep_free))):
                seq.block_table.append(self._take_free().block_id)
        finally:
            self._offload_evicted()
        return max(0, min(num_slots, len(seq.block_table) * bs - seq.num_tokens))

    def trim(self, seq: Sequence) -> None:
        """Give back seq's blocks past its tokens (the slots of rejected draft tokens): unkeyed and
        uncomputed, they go to the front of the free list, the first handed out again, so that
        prefix-cache blocks are not evicted before them."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            self._unref(block)
            if block.ref_count == 0:
                self.free_ids.move_to_end(block.block_id, last=False)

    def mark_computed(self, seq: Sequence) -> None:
        """After a step: flag full computed blocks and give them keys for the prefix cache."""
        bs = self.block_size
        n_done = seq.num_computed_tokens // bs
        for i in range(n_done):
            block = self.blocks[seq.block_table[i]]
            if block.computed:
                continue
            block.computed = True
            self._publish(block)
        while seq.num_hashed_blocks < n_done:
            i = seq.num_hashed_blocks
            parent = seq.block_hashes[i - 1] if i else salt_root(seq.params.cache_salt)
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                self._register(block, h, tokens, parent)
            seq.block_hashes.append(h)
            seq.num_hashed_blocks += 1

    def computed_keys(self) -> list[int]:
        """Every key a lookup finds computed (what routers are told is held)."""
        return [h for h, b in self.hash_to_block.items() if self.blocks[b].computed]

    def tiered_keys(self) -> list[int]:
        """Every key the KV tiers hold (routers: a load, not a recompute)."""
        return self.tiers.keys() if self.tiers is not None else []

    def computed_prefix_blocks(self, token_ids: list[int], root: int = ROOT_HASH) -> list[int]:
        """Hashes of the leading full blocks of token_ids this pool holds computed."""
        held = []
        bs = self.block_size
        for i, h in enumerate(prompt_block_hashes(token_ids, bs, root)):
            block = self._lookup(h, tuple(token_ids[i * bs:(i + 1) * bs]))
            if block is None or not block.computed:
                break
            held.append(h)
        return held

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
