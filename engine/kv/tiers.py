"""KV tiers under the prefix cache: host RAM, then disk, keyed by the same chain hashes.

The block manager offloads a computed prefix block to the tiers when it is about to reuse the
block (lazy eviction), and asks them for the blocks that follow the pool's own cached prefix
when it allocates a sequence (host first, then disk, up to the first miss); a block found is
written into a fresh pool block and counts as a prefix-cache hit. Both directions go through
``KVTiers``, which holds the pool's read and write paths (the model runner's, as the KV
hand-off uses them).

- Host tier: a bounded LRU of ``TierBlock`` (the bytes of one block across layers, with the
  parent hash and token ids a lookup compares, as the pool does against hash collisions).
  Blocks it evicts go to the disk tier when there is one.
- Disk tier: ``<kv_disk_cache_dir>/<fingerprint>/<keyed hash of the chain hash>.kv``, one file
  per block (engine/kv/tier_file.py), so engines of other models, dtypes or block sizes sharing a
  directory never see each other's blocks, and engines of the same model and user on one host
  share theirs. Both directories are 0700 and the engine's user's (made so; an existing one that
  is a symlink, another user's or open to group or others is refused, not repaired: the disk tier
  is then off, with one warning and a refusal counted, and blocks are recomputed); files are 0600,
  and read only after fstat finds a regular file of ours of the exact size expected. The names
  and each file's MAC are keyed by a secret kept 0600 in the directory (``tier.key``), or given.
  Files are written on one background thread fed by a bounded queue (full: the block is dropped
  and counted), each to a temporary name renamed into place, so readers see whole files or none;
  a block still queued is found in the queue. The index (key -> file size, least recently used
  first) bounds the bytes kept: a write first deletes the least recently used files. It is
  rebuilt from the directory at start (from the files' headers, by modification time; a hit
  touches its file), so a restarted engine serves its prefixes from disk. A key missing from the
  index is still looked for on disk (another engine may have written it). A file refused (not a
  private regular file of the expected size, or engine/kv/tier_file.decode's checks) is counted
  and deleted, unless it is a sound block of another prefix; one vanishing between index and read
  is a miss. OS errors (a full or unwritable disk) are counted and cost recomputation, never an
  exception.

Threads: lookups, offloads and the host tier run on the caller's thread under the engine's
lock. Disk writes are asynchronous, and so are the disk reads of a prompt's prefix: the first
time the scheduler considers a waiting sequence, the blocks after the pool's and the host
tier's that only the disk tier holds are read on a background thread into a bounded staging
area (``start_load``), and the sequence waits for them while the scheduler admits others; its
allocation then finds them staged. A block read neither way in time (evicted meanwhile, the
staging area full) is read synchronously by the allocation, or recomputed.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

import torch

from pdserve.engine.kv.block_manager import Evicted
from pdserve.engine.kv.tier_file import (HEADER, RefusedBlock, TierBlock, UnsafePath, block_file_name, check_secret,
    create_private, decode, encode, file_size, header_key, open_private_dir, read_checked,
    tier_secret, unlink)

log = logging.getLogger(__name__)

WRITE_QUEUE_BYTES = 64 << 20   # block bytes waiting for the disk writer, at most (at least one block)
STAGED_BYTES = 64 << 20        # block bytes read ahead from disk, waiting for their allocation
WARNINGS_LOGGED = 5            # per disk tier; the rest at debug level (the counters keep counting)
STALE_TEMP_S = 600             # a temporary block file this old was left by a killed writer (a write takes ms)
_FILE_NAME = re.compile(r"^[0-9a-f]{32}\.kv$")
STAT_KEYS = ("kv_host_hits", "kv_disk_hits", "kv_offloaded_blocks", "kv_host_blocks", "kv_host_bytes",
             "kv_disk_blocks", "kv_disk_bytes", "kv_disk_writes", "kv_tier_refused", "kv_tier_dropped_writes",
             "kv_tier_write_errors")



class HostTier:
    """A bounded LRU of blocks in host RAM."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self._blocks: OrderedDict[int, TierBlock] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self):
        return self._blocks.keys()

    def get(self, key: int) -> TierBlock | None:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def put(self, block: TierBlock) -> list[TierBlock]:
        """Keep block (the most recently used); returns the blocks evicted to stay in budget."""
        old = self._blocks.pop(block.key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._blocks[block.key] = block
        self.bytes += block.nbytes
        evicted = []
        while self.bytes > self.budget and self._blocks:
            _, out = self._blocks.popitem(last=False)
            self.bytes -= out.nbytes
            evicted.append(out)
        return evicted


class DiskTier:
    """Block files under one fingerprint's directory, bounded in bytes (see the module doc)."""

    def __init__(self, root: str | Path, budget: int, fingerprint: bytes, shape: tuple[int, ...],
                 dtype: torch.dtype, queue_blocks: int = 64, secret: bytes | None = None) -> None:
        """secret: the key of file names and MACs (16 to 64 bytes); None: the directory's own."""
        self.root = Path(root)
        self.dir = self.root / fingerprint.hex()
        self.budget = budget
        self.fingerprint = fingerprint
        self.shape, self.dtype = tuple(shape), dtype
        self.payload_bytes = torch.Size(self.shape).numel() * dtype.itemsize
        self.block_file_bytes = file_size(self.shape[2], self.payload_bytes)   # shape: [layers, 2, block_size, ...]
        self._lock = threading.Lock()   # the index, pending and byte count: shared with the writer
        self._index: OrderedDict[int, int] = OrderedDict()   # key -> file size, least recently used first
        self._pending: dict[int, TierBlock] = {}              # queued for the writer
        self._queue: queue.Queue[TierBlock | None] = queue.Queue(maxsize=max(1, queue_blocks))
        self._thread: threading.Thread | None = None
        self.bytes = 0
        self.hits = self.writes = self.refused = self.dropped = self.errors = 0
        self._warnings = 0
        self._secret = check_secret(secret) if secret is not None else b""
        self._fd = self._open_dirs(secret is None)   # the fingerprint's directory; None: the tier is off
        if self._fd is not None:
            weakref.finalize(self, os.close, self._fd)
            self._scan()

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def _open_dirs(self, own_secret: bool) -> int | None:
        """The fingerprint directory's descriptor (every file is reached through it), both
        directories private and the secret read; None (counted, one warning) if they are not."""
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            root = open_private_dir(self.root)
            try:
                if own_secret:
                    self._secret = tier_secret(root)
                return open_private_dir(self.dir.name, root, str(self.dir))
            finally:
                os.close(root)
        except UnsafePath as exc:
            self._count("refused", "KV disk tier off: %s; it must be this user's, mode 0700, not a symlink "
                        "(evicted blocks will be recomputed)", exc)
        except OSError as exc:
            self._count("errors", "KV disk tier off: %s: %s; evicted blocks will be recomputed", self.dir, exc)
        return None

    def _count(self, counter: str, warning: str | None = None, *args: object) -> None:
        """Count an event (the writer and the engine's thread both count); log the first few
        warnings at WARNING, the rest at DEBUG (a broken disk is not a log flood)."""
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)
            self._warnings += warning is not None
            n = self._warnings
        if warning is None:
            return
        if n < WARNINGS_LOGGED:
            log.warning(warning, *args)
        elif n == WARNINGS_LOGGED:
            log.warning(warning + " (further ones at debug level)", *args)
        else:
            log.debug(warning, *args)

    # ---- the index --------------------------------------------------------------------------
    def file_name(self, key: int) -> str:
        """The name of the block keyed key in self.dir (a keyed hash: see engine/kv/tier_file.py)."""
        return block_file_name(self._secret, key)

    def _scan(self) -> None:
        """Rebuild the index from the directory (least recently modified first), within budget,
        from the headers of the sound block files (the rest are refused and deleted); delete
        temporary files a killed writer left behind."""
        found = []
        try:
            with os.scandir(self._fd) as entries:
                listed = [(entry.name, entry.stat(follow_symlinks=False)) for entry in entries]
            for name, st in listed:
                if _FILE_NAME.match(name):
                    try:
                        key = header_key(read_checked(name, self._fd, self.block_file_bytes, HEADER.size),
                                         self.fingerprint)
                        if self.file_name(key) != name:
                            raise RefusedBlock(f"holds block {key:016x}, which is not named so")
                    except RefusedBlock as exc:
                        self._count("refused", "KV disk tier: refused %s: %s", self.dir / name, exc)
                        unlink(name, self._fd)
                        continue
                    except FileNotFoundError:   # deleted by a sharer meanwhile
                        continue
                    found.append((st.st_mtime_ns, key, self.block_file_bytes))
                elif name.endswith(".tmp") and time.time() - st.st_mtime > STALE_TEMP_S:
                    unlink(name, self._fd)
        except OSError as exc:
            self._count("errors", "KV disk tier %s: %s; evicted blocks will be recomputed", self.dir, exc)
        with self._lock:
            for _, key, size in sorted(found):
                self._index[key] = size
                self.bytes += size
            self._make_room(0)

    def _make_room(self, size: int) -> bool:
        """Under the lock: delete least recently used files until size more bytes fit, and count
        them in (the caller writes the file or gives them back). False: size cannot fit."""
        if size > self.budget:
            return False
        while self._index and self.bytes + size > self.budget:
            key, old = self._index.popitem(last=False)
            self.bytes -= old
            unlink(self.file_name(key), self._fd)
        self.bytes += size
        return True

    def _forget(self, key: int, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.bytes -= size
        if delete:
            unlink(self.file_name(key), self._fd)

    def holds(self, key: int) -> bool:
        """A file or the write queue holds key (a file held counts as used now)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            return key in self._pending

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[int]:
        """The keys of the files and of the blocks queued for writing."""
        with self._lock:
            return [*self._index, *(k for k in self._pending if k not in self._index)]

    # ---- reads (the caller's thread) -------------------------------------------------------
    def get(self, key: int, parent: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The block's bytes if a file (or the write queue) holds this block, verified; None otherwise."""
        if self._fd is None:
            return None
        with self._lock:
            block = self._pending.get(key)
            indexed = key in self._index
            if indexed:
                self._index.move_to_end(key)
        if block is not None:
            if block.parent == parent and block.token_ids == token_ids:
                self._count("hits")
                return block.data
            self._count("refused")   # a hash collision
            return None
        name = self.file_name(key)
        path = self.dir / name
        try:   # (a FIFO, symlink, device, another user's or a wrong-sized file: refused unread)
            buf = read_checked(name, self._fd, file_size(len(token_ids), self.payload_bytes))
            data = decode(buf, self.fingerprint, self._secret, key, parent, token_ids, self.shape, self.dtype)
        except FileNotFoundError:   # never written here, or deleted by a sharer since it was indexed
            if indexed:
                self._forget(key, delete=False)
            return None
        except RefusedBlock as exc:
            self._count("refused", "KV disk tier: refused %s: %s", path, exc)
            if not exc.keep:
                self._forget(key, delete=True)
            return None
        except OSError as exc:
            self._count("errors", "KV disk tier: reading %s: %s", path, exc)
            return None
        if not indexed:   # another engine's file: ours to keep in budget from now on
            with self._lock:
                if key not in self._index and self._make_room(len(buf)):
                    self._index[key] = len(buf)
        try:
            os.utime(name, dir_fd=self._fd, follow_symlinks=False)   # least recently used survives a restart
        except OSError:
            pass
        self._count("hits")
        return data

    # ---- writes (queued for the writer thread) ---------------------------------------------
    def put(self, block: TierBlock) -> None:
        """Queue block for writing; never blocks (a full queue, or the tier off, drops it, counted)."""
        with self._lock:
            if self._fd is None:
                self.dropped += 1
                return
            if block.key in self._pending:
                return
            if block.key in self._index:
                self._index.move_to_end(block.key)
                return
            if file_size(len(block.token_ids), block.nbytes) > self.budget:
                self.dropped += 1   # (under the lock)
                return
            self._pending[block.key] = block
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(block)
        except queue.Full:
            with self._lock:
                self._pending.pop(block.key, None)
                self.dropped += 1

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued and stop the writer (a later put starts it again)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while True:
            block = self._queue.get()
            try:
                if block is None:
                    return
                self._write(block)
            except Exception:   # never let the writer die: count it, the block is recomputed
                log.exception("KV disk tier: writing block %016x", block.key if block else 0)
                self._count("errors")
            finally:
                if block is not None:
                    with self._lock:
                        if self._pending.get(block.key) is block:
                            del self._pending[block.key]
                self._queue.task_done()

    def _write(self, block: TierBlock) -> None:
        size = file_size(len(block.token_ids), block.nbytes)
        with self._lock:
            if not self._make_room(size):
                self.dropped += 1
                return
        name = self.file_name(block.key)
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            create_private(tmp, self._fd, encode(block, self.fingerprint, self._secret))
            os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)   # atomic: whole file or none
        except OSError as exc:
            with self._lock:
                self.bytes -= size
            unlink(tmp, self._fd)
            self._count("errors", "KV disk tier: writing %s: %s (the block will be recomputed)", self.dir / name, exc)
            return
        with self._lock:
            old = self._index.pop(block.key, None)
            if old is not None:
                self.bytes -= old
            self._index[block.key] = size
            self.writes += 1
            self._pending.pop(block.key, None)   # findable in the index from now on


class KVTiers:
    """The tiers under one pool's prefix cache: what the block manager calls."""

    def __init__(self, read: Callable[[list[int]], torch.Tensor], write: Callable[[list[int], torch.Tensor], None],
                 host_bytes: int = 0, disk: DiskTier | None = None) -> None:
        """read(block_ids) -> [n, *block shape] on CPU, write(block_ids, data): the pool's bytes."""
        self._read, self._write = read, write
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = disk if disk is not None and disk.enabled else None   # (off: as if none)
        self._disk_counts = disk
        self.host_hits = self.offloaded = self.refused = 0
        self.loaded_blocks = 0
        self.load_s = 0.0   # time spent finding and writing back the blocks loaded
        self.prefetched = 0   # blocks read ahead from disk in the background
        self._staged: OrderedDict[int, TierBlock] = OrderedDict()   # read ahead, oldest first
        self._staged_bytes = 0
        self._staged_lock = threading.Lock()   # the staging area and the reads in flight (_loads)
        self._reader: ThreadPoolExecutor | None = None
        self._loads: set[Future] = set()

    def offload(self, victims: list[Evicted]) -> tuple[list[int], list[int]]:
        """Copy the blocks the pool is about to reuse into the tiers (those not held already).
        Returns the victims' keys the tiers hold now, and the keys they no longer hold (a victim
        not taken, a block the host tier dropped with no disk tier under it). A block on its way
        to disk counts as held (a disk tier that drops it later does not say so)."""
        held = [v.key for v in victims if self._holds(v.key)]
        held_keys = set(held)
        todo = [v for v in victims if v.key not in held_keys]
        if not todo:
            return held, []
        try:
            data = self._read([v.block_id for v in todo])
        except Exception:   # the pool's own read: should not fail; the blocks are recomputed if it does
            log.exception("KV tiers: reading %d evicted blocks", len(todo))
            return held, [v.key for v in todo]
        dropped: list[int] = []
        for i, v in enumerate(todo):
            dropped += self._store(TierBlock(v.key, v.parent, v.token_ids,
                                             data[i] if len(todo) == 1 else data[i].clone()))
        self.offloaded += len(todo)
        gone = set(dropped)
        return [k for k in [*held, *(v.key for v in todo)] if k not in gone], dropped

    def keys(self) -> list[int]:
        """Every key a tier holds (the host tier's, the disk index's)."""
        host = list(self.host.keys()) if self.host is not None else []
        return host + (self.disk.keys() if self.disk is not None else [])

    def _holds(self, key: int) -> bool:
        """The first tier an offload would go to holds key already (a host hit refreshes it)."""
        if self.host is not None:
            return self.host.get(key) is not None
        return self.disk is not None and self.disk.holds(key)

    def _store(self, block: TierBlock) -> list[int]:
        """Keep block; returns the keys no tier holds any more (spilled with no disk tier)."""
        spill = [block]
        if self.host is not None and block.nbytes <= self.host.budget:
            spill = self.host.put(block)
        if self.disk is None:
            return [out.key for out in spill]
        for out in spill:
            self.disk.put(out)
        return []

    def fetch(self, key: int, parent: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The bytes of the block keyed key, derived from parent and token_ids, if a tier holds it."""
        t0 = time.perf_counter()
        try:
            data = self._fetch(key, parent, token_ids)
        except Exception:   # a tier fault costs recomputation, never the allocation
            log.exception("KV tiers: looking up block %016x", key)
            return None
        if data is not None:
            self.load_s += time.perf_counter() - t0
        return data

    # ---- reads ahead from disk ----------------------------------------------------------------
    def holds_in_host(self, key: int) -> bool:
        return self.host is not None and key in self.host.keys()

    def holds_on_disk(self, key: int) -> bool:
        """The disk tier holds key, and it is not read ahead already."""
        if self.disk is None:
            return False
        with self._staged_lock:
            if key in self._staged:
                return False
        return self.disk.holds(key)

    def start_load(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> Future:
        """Read these blocks (key, parent, token ids: a run of one prompt's chain) from the disk
        tier on the reader thread into the staging area, up to the first miss. Done: the future."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")
        future = self._reader.submit(self._read_ahead, blocks)
        with self._staged_lock:
            self._loads.add(future)
        future.add_done_callback(self._load_done)
        return future

    def _load_done(self, future: Future) -> None:   # (on the reader thread)
        with self._staged_lock:
            self._loads.discard(future)

    def _read_ahead(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> None:
        for key, parent, token_ids in blocks:
            try:
                data = self.disk.get(key, parent, token_ids)
            except Exception:   # a fault costs recomputation
                log.exception("KV tiers: reading block %016x ahead", key)
                return
            if data is None:
                return
            block = TierBlock(key, parent, token_ids, data)
            with self._staged_lock:
                if block.nbytes > STAGED_BYTES:
                    return
                self._staged[key] = block
                self._staged_bytes += block.nbytes
                while self._staged_bytes > STAGED_BYTES:
                    _, out = self._staged.popitem(last=False)
                    self._staged_bytes -= out.nbytes
                self.prefetched += 1

    def wait_for_loads(self, timeout: float) -> bool:
        """Wait (at most timeout s) until a read ahead ends; False when none runs."""
        with self._staged_lock:
            loads = list(self._loads)
        if not loads:
            return False
        wait(loads, timeout, return_when=FIRST_COMPLETED)
        return True

    def _take_staged(self, key: int, parent: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        with self._staged_lock:
            block = self._staged.pop(key, None)
            if block is not None:
                self._staged_bytes -= block.nbytes
        if block is not None and block.parent == parent and block.token_ids == token_ids:
            return block.data
        return None

    def _fetch(self, key: int, parent: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        if self._staged:
            data = self._take_staged(key, parent, token_ids)
            if data is not None:
                return data
        if self.host is not None:
            block = self.host.get(key)
            if block is not None:
                if block.parent == parent and block.token_ids == token_ids:
                    self.host_hits += 1
                    return block.data
                self.refused += 1   # a hash collision: recompute
                return None
        if self.disk is not None:
            return self.disk.get(key, parent, token_ids)
        return None

    def write(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """Write fetched blocks' bytes into these pool blocks."""
        t0 = time.perf_counter()
        self._write(block_ids, torch.stack(data))
        self.load_s += time.perf_counter() - t0
        self.loaded_blocks += len(block_ids)

    @property
    def load_ms_per_block(self) -> float:
        """The mean time a block loaded from a tier took, lookup and write into the pool (0: none yet)."""
        return self.load_s * 1e3 / self.loaded_blocks if self.loaded_blocks else 0.0

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict[str, int]:
        host = self.host if self.host is not None else HostTier(0)   # (tiers have a len: never test their truth)
        disk = self._disk_counts   # (a disk tier turned off still reports its refusal or error)
        return {
            "kv_host_hits": self.host_hits,
            "kv_disk_hits": disk.hits if disk is not None else 0,
            "kv_offloaded_blocks": self.offloaded,
            "kv_host_blocks": len(host),
            "kv_host_bytes": host.bytes,
            "kv_disk_blocks": len(disk) if disk is not None else 0,
            "kv_disk_bytes": disk.bytes if disk is not None else 0,
            "kv_disk_writes": disk.writes if disk is not None else 0,
            "kv_tier_refused": self.refused + (disk.refused if disk is not None else 0),
            "kv_tier_dropped_writes": disk.dropped if disk is not None else 0,
            "kv_tier_write_errors": disk.errors if disk is not None else 0,
        }


def no_tier_stats() -> dict[str, int]:
    return dict.fromkeys(STAT_KEYS, 0)
