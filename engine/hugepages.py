"""Transparent huge pages for large, streamed CPU buffers (the KV pool, packed weights).

Decode attention streams the KV cache and decode GEMMs stream the weights: both are bound by
memory bandwidth, and with 4 KiB pages TLB misses cost a good part of it (measured on one core:
10.7 GB/s with 4 KiB pages, 14-15.5 GB/s on 2 MiB pages). On Linux with THP in ``always`` or
``madvise`` mode, buffers allocated here are anonymous mappings marked ``MADV_HUGEPAGE``
before their first touch (then touched once, so they are faulted in as 2 MiB pages), and buffers
filled elsewhere can be collapsed in place (``MADV_COLLAPSE``, Linux >= 6.1). Anywhere else
(THP ``never``, other kernels, other systems) the same calls quietly fall back to ordinary
zeroed tensors and no-ops.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import platform
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
MIN_BYTES = 4 * HUGE_PAGE   # smaller buffers are not worth a mapping of their own
ARENA_BYTES = 64 << 20      # move_onto_huge_pages: what is held twice at most while tensors move


@lru_cache(maxsize=1)
def thp_mode() -> str:
    """"always", "madvise", "never", or "unsupported" (no THP on this system)."""
    if platform.system() != "Linux":
        return "unsupported"
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unsupported"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unsupported"


def enabled() -> bool:
    return thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, on huge pages where the system has them. Its memory is touched
    (faulted in) here, as torch.zeros does, so first use later pays no page faults: in a VM a
    first touch of fresh memory can cost far more than the zeroing itself."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if not enabled() or nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    try:
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(mm, dtype=torch.uint8)      # keeps mm alive
    start = -raw.data_ptr() % HUGE_PAGE                # a 2 MiB-aligned start: whole huge pages
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, start, (len(mm) - start) // mmap.PAGESIZE * mmap.PAGESIZE)
    except (OSError, ValueError):
        pass                                           # still a valid zeroed mapping
    out = raw[start:start + nbytes]
    out.zero_()                                        # fault every page in now, 2 MiB at a time
    return out.view(dtype).view(shape)


def consolidate(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU tensors in one huge-page arena (each 64-byte aligned), or the tensors
    themselves where the system has no huge pages."""
    if not tensors or not enabled():
        return tensors
    sizes = [-(-t.numel() * t.dtype.itemsize // 64) * 64 for t in tensors]
    arena = zeros((sum(sizes),), torch.uint8)
    out, off = [], 0
    for t, size in zip(tensors, sizes):
        view = arena[off:off + t.numel() * t.dtype.itemsize].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        off += size
    return out


def move_onto_huge_pages(owners: list[object], attr: str, arena_bytes: int = ARENA_BYTES) -> None:
    """Replace each owner's CPU tensor ``attr`` (None: skipped) with a copy on huge pages, one
    arena per arena_bytes or so of them, each owner's old tensor dropped as its group moves: no
    more than a group is held twice at once (a model's packed weights, moved as one arena, would
    be held twice while they load)."""
    group: list[object] = []
    size = 0
    for owner in owners:
        t = getattr(owner, attr)
        if t is None:
            continue
        group.append(owner)
        size += t.numel() * t.element_size()
        if size >= arena_bytes:
            _move(group, attr)
            group, size = [], 0
    if group:
        _move(group, attr)


def _move(owners: list[object], attr: str) -> None:
    for owner, moved in zip(owners, consolidate([getattr(o, attr) for o in owners])):
        setattr(owner, attr, moved)


def collapse(t: torch.Tensor) -> bool:
    """Move the 2 MiB-aligned part of a filled CPU tensor's memory onto huge pages now
    (synchronous; ~2.5 ms per MiB). Returns whether the kernel did so."""
    if not enabled() or t.device.type != "cpu" or t.untyped_storage().nbytes() < HUGE_PAGE:
        return False
    lib = _libc()
    if lib is None:
        return False
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    return lib.madvise(lo, hi - lo, MADV_COLLAPSE) == 0


def huge_bytes() -> int:
    """AnonHugePages of this process (bytes), for logs and benchmarks; 0 where unknown."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
