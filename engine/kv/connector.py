"""The KV hand-off's single owner: every request's transfer state lives here, and only here.

Producer side (prefill role). A prompt's blocks are exported chunk by chunk: after each step
``export`` names the blocks completed since the last export (the step copies their bytes out
before the next step can touch the pool). When the prompt's last chunk is computed the
sequence is *pinned*: its blocks stay allocated until the transport reports them delivered
(``release``) or the request is aborted, and a pin older than the lease cap is freed.

Consumer side (decode role). One :class:`ReceiveHandle` per request::

    reserve ─▶ RESERVED ─(first block)─▶ RECEIVING ─(all blocks)─▶ READY ─(admit)─▶ running
                  │                           │                       │
                  └────── fail / lease lapse ─┴───────────────────────┘─▶ FAILED / EXPIRED

A reservation holds blocks for the whole sequence (the blocks this pool already holds
computed are shared, not shipped). Its lease lapses after ``idle_s`` without progress (a
received block, or a heartbeat from the prefill side) and can never outlive ``max_s``. Any
refused block fails the request at once. Every path that ends a handle frees its blocks here,
through the pool, and remembers why (bounded), so a later ``admit`` gets a clear error.

A block is checked by ``accept`` (or ``accept_many``): the caller's transfer token, the block's
index, its chain hash (recomputed from the reserved tokens), its layout against this pool,
its CRC-32 when the header carries one (non-zero; the transports instead MAC each frame before
any of its blocks reaches here, which supersedes it); or by ``claim_run``, for a transport that
writes a frame's payload straight into the pool: the blocks count as received at ``finish_run``,
once their frame's MAC held. Received blocks get prefix-cache keys only when the whole request is verified.

Tensor-parallel layouts. A block may arrive as pieces, each carrying KV heads
[head_start, head_end) (a prefill worker with TP=p ships each rank's heads as they are held);
each piece is checked as above, may not repeat a head already received, and is written
through the pool's ``write`` (the runner's ``write_block``), which gives each of this worker's ranks the heads it holds
(re-sharding happens here, not in the model). A block is complete once every head arrived, so
any prefill layout feeds any decode layout.

The engine calls the connector at fixed points and never reads its tables: ``on_add`` (a
request queued), ``on_chunk`` / ``on_first_token`` (a prompt chunk computed, the first token
sampled: the producer exports, and on the first token keeps the sequence's blocks pinned),
``owns``, ``abort``, ``fail_all``, ``expire`` and ``stats``. The worker's role picks the side
(``set_role``, at construction and again when an idle worker switches roles): "prefill" installs
the producer hooks, "decode" paces its local prompts by the engine's learned step costs, "both"
does neither (every role may reserve and receive).
Blocks are reached only through a :class:`engine.kv.pool.KVBlockPool`.

The worker services use public methods only, never the tables, the pool or the lease: ``subscribe``
(hand-offs ending, bytes stored), ``state``, ``failure``, ``fail``, ``expire``, ``read_block_pieces``
and ``pinned_views`` (a finished prefill's blocks), ``bytes_per_block`` and ``max_lease_s``; the
receiving transports call ``authorize``, ``heartbeat``, ``check_many``, ``accept_many``,
``claim_run`` / ``finish_run``. ``mark_received`` is for a simulator that moves no bytes.

Thread safety: the public methods take the engine's (re-entrant) lock, which the engine
thread holds only between forward passes, so transports call in from any thread and never
wait for a step to end.
"""
from __future__ import annotations

import functools
import hmac
import secrets
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.engine.kv.handoff import BlockMeta, Failure, HandoffError, HandoffState, LeasePolicy, Reservation
from pdserve.engine.kv.pool import KVBlockPool
from pdserve.engine.sequence import Sequence, SequenceStatus

MAX_REMEMBERED_FAILURES = 1024


def _head_mask(start: int, end: int) -> int:
    return (1 << end) - (1 << start)


def _locked(method: Callable) -> Callable:
    """Run the method under the owning engine's (re-entrant) lock."""
    @functools.wraps(method)
    def wrapper(self: "KVConnector", *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return wrapper


@dataclass(eq=False)
class ReceiveHandle:
    seq: Sequence
    hashes: list[int]               # transfer hash of every block, the partial last one included
    needed: set[int]
    token: bytes
    deadline: float                 # lease cap (monotonic)
    expires_at: float               # idle lapse (monotonic)
    state: HandoffState = HandoffState.RESERVED
    heads: dict[int, int] = field(default_factory=dict)   # block index -> bit mask of KV heads received
    writers: int = 0                # claimed runs being written outside the lock: the blocks stay allocated

    @property
    def request_id(self) -> str:
        return self.seq.request_id


@dataclass(eq=False)
class SendHandle:
    """Prefill role: blocks exported so far, and the pin once the prompt is computed."""

    seq: Sequence
    exported: int = 0               # leading blocks already reported ready
    pinned_until: float | None = None


@dataclass(eq=False)
class ClaimedRun:
    """Whole blocks of one request a transport writes straight into the pool (claim_run, finish_run)."""

    handle: ReceiveHandle
    metas: list[BlockMeta]
    slabs: list[memoryview]         # where their bytes go, in the wire's order
    nbytes: int


class KVConnector:
    """Owned by an LLMEngine; see the module docstring. lock: the engine's (re-entrant) lock."""

    def __init__(self, pool: KVBlockPool, lock: threading.RLock, role: str = "both",
                 lease: LeasePolicy | None = None) -> None:
        self.pool = pool
        self.lock = lock
        self.lease = lease or LeasePolicy()
        self.block_size = pool.block_size
        self.receiving: dict[str, ReceiveHandle] = {}
        self.sending: dict[str, SendHandle] = {}
        self.exports = False               # producer hooks: export, pin until delivered
        self.paces_local_prompts = False   # a local prompt's chunk fits beside decodes
        self.set_role(role)
        self.failures: OrderedDict[str, Failure] = OrderedDict()
        # Called (under the engine lock) when a handle becomes READY, FAILED or EXPIRED, and for
        # every run of blocks stored (their bytes): the worker's metrics and waiters (subscribe).
        self._on_change: list[Callable[[str, HandoffState], None]] = []
        self._on_block: list[Callable[[int], None]] = []
        self._shape: tuple[int, ...] | None = None                 # the pool's block shape, asked once
        self._layouts: dict[int, tuple[str, tuple[int, ...], int]] = {}   # heads -> a block's layout

    @_locked
    def set_role(self, role: str) -> None:
        """Take the side of role: "prefill" exports and pins, "decode" paces local prompts, "both"
        neither. Only while no request is received or held for sending (ValueError otherwise):
        a handle never sees its hooks change."""
        if self.receiving or self.sending:
            raise ValueError(f"the KV connector cannot switch to role {role!r} while it holds "
                             f"{len(self.receiving)} reception(s) and {len(self.sending)} send(s)")
        self.exports = role == "prefill"
        self.paces_local_prompts = role == "decode"

    # ---- what the worker services read and watch ------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """One block's KV bytes in this pool (every layer, every KV head)."""
        return self.pool.bytes_per_block

    @property
    def max_lease_s(self) -> float:
        """The lease cap: no reservation, and no pin of a finished prefill, outlives it."""
        return self.lease.max_s

    @_locked
    def subscribe(self, on_change: Callable[[str, HandoffState], None] | None = None,
                  on_block: Callable[[int], None] | None = None) -> None:
        """Call on_change(request_id, state) whenever a reception becomes READY, FAILED or EXPIRED,
        and on_block(nbytes) for every run of received blocks stored; both under the engine lock,
        from whichever thread made the change, in the order they subscribed."""
        if on_change is not None:
            self._on_change.append(on_change)
        if on_block is not None:
            self._on_block.append(on_block)

    # ---- the engine's hooks ---------------------------------------------------------------
    def owns(self, request_id: str) -> bool:
        """The request is being received or its blocks are held for sending."""
        return request_id in self.receiving or request_id in self.sending

    def on_add(self, seq: Sequence) -> None:
        """A request was queued for a local prefill."""
        if self.exports:
            self.sending[seq.request_id] = SendHandle(seq)

    def on_drop(self, request_id: str) -> None:
        """The engine ended a sequence it schedules (it frees the blocks)."""
        self.sending.pop(request_id, None)

    def on_chunk(self, seq: Sequence) -> list[int] | None:
        """A prompt chunk was computed: the blocks exportable now (None: nothing is exported)."""
        return self._export(seq, final=False) if self.exports else None

    def on_first_token(self, seq: Sequence) -> list[int] | None:
        """The prompt is computed and its next token sampled. The producer exports the rest and
        keeps the blocks pinned until ``release``: returns the blocks exportable now, and the
        engine ends the sequence without freeing them. None: the sequence goes on decoding here."""
        if not self.exports:
            return None
        ready = self._export(seq, final=True)
        self.sending[seq.request_id].pinned_until = time.monotonic() + self.lease.max_s
        return ready

    @_locked
    def abort(self, request_id: str) -> bool:
        """A request the engine does not schedule: fail its reception or drop its pin (blocks freed)."""
        if request_id in self.receiving:
            return self.fail(request_id, "ABORTED", f"request {request_id!r} was aborted")
        return self.release(request_id)

    @_locked
    def fail_all(self, code: str, message: str) -> None:
        """Every reception fails and every pin is dropped (the worker cannot step again)."""
        for rid in list(self.receiving):
            self.fail(rid, code, message)
        for rid in list(self.sending):
            self.release(rid)

    @_locked
    def stats(self) -> dict[str, int]:
        return {"num_reserved": len(self.receiving),
                "num_pinned": sum(1 for h in self.sending.values() if h.pinned_until is not None)}

    @_locked
    def expire(self, now: float | None = None) -> list[str]:
        """Free every reservation whose lease lapsed and every pin older than the lease cap."""
        now = time.monotonic() if now is None else now
        lapsed = [h for h in self.receiving.values() if now >= min(h.expires_at, h.deadline)]
        for h in lapsed:
            why = "lease cap" if now >= h.deadline else f"no KV progress for {self.lease.idle_s:g}s"
            self._end(h, HandoffState.EXPIRED, "DEADLINE_EXCEEDED", f"reservation of {h.request_id!r} expired ({why})")
        stale = [s for s in self.sending.values() if s.pinned_until is not None and now >= s.pinned_until]
        for s in stale:
            self.pool.free(self.sending.pop(s.seq.request_id).seq)
        return [h.request_id for h in lapsed] + [s.seq.request_id for s in stale]

    def failure(self, request_id: str) -> Failure | None:
        return self.failures.get(request_id)

    def _remember(self, request_id: str, failure: Failure) -> None:
        self.failures[request_id] = failure
        self.failures.move_to_end(request_id)
        while len(self.failures) > MAX_REMEMBERED_FAILURES:
            self.failures.popitem(last=False)

    def _end(self, handle: ReceiveHandle, state: HandoffState, code: str, message: str) -> None:
        handle.state = state
        self.receiving.pop(handle.request_id, None)
        handle.seq.status, handle.seq.finish_reason = SequenceStatus.FINISHED, "abort"
        if not handle.writers:   # else the last writer frees them (finish_run): no block is reused mid-write
            self.pool.free(handle.seq)
        self._remember(handle.request_id, Failure(code, message))
        self._notify(handle.request_id, state)

    def _notify(self, request_id: str, state: HandoffState) -> None:
        for on_change in self._on_change:
            on_change(request_id, state)

    # ---- producer (prefill role) --------------------------------------------------------
    def _export(self, seq: Sequence, final: bool) -> list[int]:
        """Block indices completed since the last export (a final export includes the partial tail)."""
        handle = self.sending[seq.request_id]
        bs = self.block_size
        done = -(-seq.num_computed_tokens // bs) if final else seq.num_computed_tokens // bs
        ready = list(range(handle.exported, done))
        handle.exported = max(handle.exported, done)
        return ready

    @_locked
    def release(self, request_id: str) -> bool:
        """The pinned blocks were delivered (or will not be): they fall back to the prefix cache."""
        handle = self.sending.get(request_id)
        if handle is None or handle.pinned_until is None:
            return False
        del self.sending[request_id]
        self.pool.free(handle.seq)
        return True

    @_locked
    def read_blocks(self, request_id: str, block_indices: list[int]) -> torch.Tensor:
        table = self.sending[request_id].seq.block_table
        return self.pool.read([table[i] for i in block_indices])

    @_locked
    def read_block_pieces(self, request_id: str,
                          block_indices: list[int]) -> list[tuple[int, int, torch.Tensor]] | None:
        """The blocks as the ranks hold them: (head_start, head_end, [n, *block shape with those heads])
        per distinct tensor-parallel slice; one piece with every head without tensor parallelism.
        None when the request's blocks are not held for sending (it was aborted)."""
        handle = self.sending.get(request_id)
        if handle is None:
            return None
        return self.pool.read_pieces([handle.seq.block_table[i] for i in block_indices])

    @_locked
    def pinned_views(self, request_id: str,
                     block_indices: list[int]) -> list[tuple[int, int, list[torch.Tensor]]] | None:
        """As read_block_pieces for a finished prefill's pinned blocks, without copying them: one
        piece of views into the pool (KVConnector.release ends their life; the sender must be done
        with them first). None when the request's blocks are not held for sending, or the pool
        cannot hand out views (read_block_pieces then)."""
        handle = self.sending.get(request_id)
        if handle is None or handle.pinned_until is None:
            return None
        views = self.pool.views([handle.seq.block_table[i] for i in block_indices])
        return None if views is None else [(0, self._block_shape()[3], views)]

    # ---- consumer (decode role) ---------------------------------------------------------
    @_locked
    def reserve(self, seq: Sequence, lease_s: float | None = None, reserve_blocks: int = 0) -> Reservation:
        """Allocate blocks for the whole sequence; raises NoFreeBlocks."""
        cached = self.pool.allocate_for_receive(seq, reserve_blocks=reserve_blocks)
        seq.status = SequenceStatus.RECEIVING
        seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
        seq.first_scheduled_time = time.monotonic()
        bs = self.block_size
        hashes = self.pool.transfer_hashes(seq)
        first_needed = cached // bs
        idle = min(lease_s, self.lease.idle_s) if lease_s else self.lease.idle_s
        now = time.monotonic()
        handle = ReceiveHandle(seq, hashes, set(range(first_needed, len(seq.block_table))), secrets.token_bytes(16),
                               deadline=now + self.lease.max_s, expires_at=now + idle)
        self.receiving[seq.request_id] = handle
        self.failures.pop(seq.request_id, None)
        if not handle.needed:
            self._ready(handle)
        return Reservation(seq.request_id, sorted(handle.needed), hashes[:first_needed], len(hashes),
                           handle.token, idle)

    def _handle(self, request_id: str, token: bytes) -> ReceiveHandle:
        handle = self.receiving.get(request_id)
        if handle is None:
            failure = self.failures.get(request_id)
            if failure is not None:
                raise HandoffError(failure.code, failure.message)
            raise HandoffError("NOT_FOUND", f"no reservation for request {request_id!r}")
        if not hmac.compare_digest(handle.token, token):
            raise HandoffError("UNAUTHENTICATED", f"wrong transfer token for request {request_id!r}")
        return handle

    @_locked
    def authorize(self, request_id: str, token: bytes) -> None:
        """A transport stream opens: the caller must hold the reservation's token."""
        self._handle(request_id, token)

    @_locked
    def heartbeat(self, request_id: str, token: bytes) -> float:
        """The prefill side is still working on the request: extend the lease. Returns the new lapse (s)."""
        handle = self._handle(request_id, token)
        now = time.monotonic()
        handle.expires_at = max(handle.expires_at, min(now + self.lease.idle_s, handle.deadline))
        return handle.expires_at - now

    @_locked
    def check(self, meta: BlockMeta, token: bytes) -> ReceiveHandle:
        """Everything about a block that can be checked before its bytes are allocated.
        A refusal fails the whole request (fail closed)."""
        return self.check_many([meta], token)

    @_locked
    def check_many(self, metas: list[BlockMeta], token: bytes) -> ReceiveHandle:
        """check for blocks of one request (a frame's headers), under one lock: the first refusal
        fails the request. Returns its handle."""
        return self._checked(metas, token)[0]

    def _checked(self, metas: list[BlockMeta], token: bytes) -> tuple[ReceiveHandle, list[tuple[int, int]]]:
        """check_many's work (the caller holds the lock); also returns each block's head range."""
        if not metas:
            raise HandoffError("INVALID_ARGUMENT", "no blocks")
        request_id = metas[0].request_id
        if any(m.request_id != request_id for m in metas):
            raise HandoffError("INVALID_ARGUMENT", "blocks of several requests in one run")
        handle = self._handle(request_id, token)
        if handle.state not in (HandoffState.RESERVED, HandoffState.RECEIVING):
            raise HandoffError("FAILED_PRECONDITION", f"request {request_id!r} is {handle.state.value}")
        try:
            return handle, self._check_blocks(handle, metas)
        except HandoffError as exc:
            self._end(handle, HandoffState.FAILED, exc.code, str(exc))
            raise

    def _check_blocks(self, handle: ReceiveHandle, metas: list[BlockMeta]) -> list[tuple[int, int]]:
        """Each block requested and not yet received, its chain hash and layout right, its heads
        not received before nor twice among metas. Returns each block's head range."""
        n_layers, _, _, n_heads, _ = block_shape = self._block_shape()
        needed, hashes, heads = handle.needed, handle.hashes, handle.heads
        ranges, seen = [], {}
        for meta in metas:
            index = meta.block_index
            if index not in needed:
                raise HandoffError("DATA_LOSS", f"block {index} of {meta.request_id!r} was not requested "
                                                f"or already received")
            if hashes[index] != meta.block_hash:
                raise HandoffError("DATA_LOSS", f"block {index} of {meta.request_id!r}: chain hash mismatch")
            start, end = self._head_range(meta, n_heads)
            layout = self._layouts.get(end - start)
            if layout is None:
                shape = list(block_shape)
                shape[3] = end - start
                layout = self._layouts[end - start] = (self.pool.dtype_name, tuple(shape),
                                                       self.pool.bytes_per_block // n_heads * (end - start))
            if (meta.dtype, tuple(meta.shape), meta.nbytes) != layout or (meta.layer_start, meta.layer_end) not in (
                    (0, 0), (0, n_layers)):
                raise HandoffError("DATA_LOSS", f"block layout {meta.dtype}{list(meta.shape)} ({meta.nbytes} bytes, "
                                                f"layers [{meta.layer_start}, {meta.layer_end}), KV heads "
                                                f"[{start}, {end})) != {layout[0]}{list(layout[1])} ({layout[2]} bytes)")
            mask = _head_mask(start, end)
            got = seen.get(index, 0) | heads.get(index, 0)
            if got & mask:
                raise HandoffError("DATA_LOSS", f"block {index} of {meta.request_id!r}: KV heads "
                                                f"[{start}, {end}) overlap heads already received")
            seen[index] = seen.get(index, 0) | mask
            ranges.append((start, end))
        return ranges

    @_locked
    def accept(self, meta: BlockMeta, token: bytes, payload: memoryview | bytes | bytearray) -> HandoffState:
        """Verify one block's bytes and write them into its reserved block. Returns the state after."""
        return self.accept_many([meta], token, payload)

    @_locked
    def accept_many(self, metas: list[BlockMeta], token: bytes, payload: memoryview | bytes | bytearray
                    ) -> HandoffState:
        """accept for blocks of one request whose bytes run back to back in payload (say, a frame's
        whole blocks): every block checked as check_many checks it (again: another stream may have
        delivered one since its announcement) before any is written, then written into the pool
        together (one copy per run of blocks with the same heads). Returns the state after."""
        view = memoryview(payload).cast("B")
        handle, ranges = self._checked(metas, token)
        try:
            total = sum(m.nbytes for m in metas)
            if view.nbytes != total:
                raise HandoffError("DATA_LOSS", f"block {metas[0].block_index}: {view.nbytes} bytes, header says {total}")
            at = 0
            for meta in metas:
                if meta.checksum:
                    crc = zlib.crc32(view[at:at + meta.nbytes]) & 0xFFFFFFFF
                    if crc != meta.checksum:
                        raise HandoffError("DATA_LOSS", f"block {meta.block_index} of {meta.request_id!r}: checksum "
                                                        f"mismatch (header {meta.checksum:#010x}, payload {crc:#010x})")
                at += meta.nbytes
        except HandoffError as exc:
            self._end(handle, HandoffState.FAILED, exc.code, str(exc))
            raise
        with warnings.catch_warnings():   # a transport's read-only buffer: the pool copies from it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(view, dtype=self.pool.dtype)
        # Re-sharding happens here: the runner writes each rank's share of these heads.
        at = i = 0
        while i < len(metas):   # runs of blocks with the same heads (all of them, but for TP pieces)
            j = i + 1
            while j < len(metas) and ranges[j] == ranges[i] and metas[j].shape == metas[i].shape:
                j += 1
            n = sum(m.nbytes for m in metas[i:j]) // self.pool.dtype.itemsize
            self.pool.write_many([handle.seq.block_table[m.block_index] for m in metas[i:j]],
                                 data[at:at + n].view(j - i, *metas[i].shape), head_start=ranges[i][0])
            at, i = at + n, j
        return self._received(handle, metas, ranges, total)

    def _received(self, handle: ReceiveHandle, metas: list[BlockMeta], ranges: list[tuple[int, int]],
                  nbytes: int) -> HandoffState:
        """Blocks (their heads in ranges) written and verified: a block with every head is no longer
        needed; the lease is extended, and the request is READY once nothing is needed."""
        all_heads = _head_mask(0, self._block_shape()[3])
        for meta, (start, end) in zip(metas, ranges):
            got = handle.heads.get(meta.block_index, 0) | _head_mask(start, end)
            if got == all_heads:
                handle.heads.pop(meta.block_index, None)
                handle.needed.discard(meta.block_index)
            else:
                handle.heads[meta.block_index] = got
        for on_block in self._on_block:
            on_block(nbytes)
        handle.state = HandoffState.RECEIVING
        handle.expires_at = max(handle.expires_at, min(time.monotonic() + self.lease.idle_s, handle.deadline))
        if not handle.needed:
            self._ready(handle)
        return handle.state

    @_locked
    def claim_run(self, metas: list[BlockMeta], token: bytes) -> ClaimedRun | None:
        """Whole blocks of one request (every KV head) claimed to be written outside the lock, say
        from a socket: checked as check_many checks them, marked as arriving (no other stream may
        deliver them), kept allocated until finish_run whatever ends the request meanwhile. None
        (nothing claimed): the pool cannot hand out its bytes, or these are pieces; use accept_many."""
        if self.pool.slabs([]) is None:
            return None
        handle, ranges = self._checked(metas, token)
        n_heads = self._block_shape()[3]
        if any(r != (0, n_heads) for r in ranges):
            return None   # pieces of blocks (a tensor-parallel sender's heads): accept_many re-shards them
        handle.heads.update((meta.block_index, _head_mask(0, n_heads)) for meta in metas)
        handle.writers += 1
        slabs = self.pool.slabs([handle.seq.block_table[m.block_index] for m in metas])
        return ClaimedRun(handle, metas, slabs, sum(m.nbytes for m in metas))

    @_locked
    def finish_run(self, run: ClaimedRun, written: bool) -> HandoffState:
        """A claimed run's end; written: its bytes are in place and verified (they count as received),
        else the caller fails the request. Raises why when the request ended meanwhile (blocks freed)."""
        handle = run.handle
        handle.writers -= 1
        if self.receiving.get(handle.request_id) is not handle:   # ended meanwhile
            if not handle.writers:
                self.pool.free(handle.seq)
            failure = self.failures.get(handle.request_id) or Failure("ABORTED", "the reservation ended")
            raise HandoffError(failure.code, failure.message)
        if not written:
            return handle.state
        return self._received(handle, run.metas, [(0, self._block_shape()[3])] * len(run.metas), run.nbytes)

    def _block_shape(self) -> tuple[int, ...]:
        """The pool's block shape (fixed for its life: asked once)."""
        if self._shape is None:
            self._shape = tuple(self.pool.block_shape)
        return self._shape

    @staticmethod
    def _head_range(meta: BlockMeta, n_heads: int) -> tuple[int, int]:
        if (meta.head_start, meta.head_end) == (0, 0):
            return 0, n_heads
        if not 0 <= meta.head_start < meta.head_end <= n_heads:
            raise HandoffError("DATA_LOSS", f"block {meta.block_index}: KV heads [{meta.head_start}, "
                                            f"{meta.head_end}) outside this model's {n_heads}")
        return meta.head_start, meta.head_end

    @_locked
    def fail(self, request_id: str, code: str, message: str) -> bool:
        """The transport saw the request's KV fail (e.g. a stream broke): free it, remember why."""
        handle = self.receiving.get(request_id)
        if handle is None:
            return False
        self._end(handle, HandoffState.FAILED, code, message)
        return True

    def _ready(self, handle: ReceiveHandle) -> None:
        handle.state = HandoffState.READY
        self._notify(handle.request_id, HandoffState.READY)

    @_locked
    def mark_received(self, request_id: str) -> bool:
        """Count every block the reservation still needs as received and verified, without their
        bytes (a simulator, which moves none): the request is READY. False: no such reservation."""
        handle = self.receiving.get(request_id)
        if handle is None:
            return False
        handle.needed.clear()
        handle.heads.clear()
        self._ready(handle)
        return True

    @_locked
    def state(self, request_id: str) -> HandoffState | None:
        handle = self.receiving.get(request_id)
        if handle is not None:
            return handle.state
        failure = self.failures.get(request_id)
        return None if failure is None else (HandoffState.EXPIRED if failure.code == "DEADLINE_EXCEEDED"
                                             else HandoffState.FAILED)

    @_locked
    def take_ready(self, request_id: str) -> Sequence:
        """Hand a READY request's sequence to the engine for admission."""
        handle = self.receiving.get(request_id)
        if handle is None or handle.state is not HandoffState.READY:
            if handle is None:
                failure = self.failures.get(request_id)
                if failure is not None:
                    raise HandoffError(failure.code, failure.message)
                raise HandoffError("NOT_FOUND", f"no reservation for request {request_id!r}")
            raise HandoffError("FAILED_PRECONDITION",
                               f"request {request_id!r} still misses blocks {sorted(handle.needed)[:8]}")
        del self.receiving[request_id]
        return handle.seq
