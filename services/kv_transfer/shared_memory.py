"""Same-host KV payloads through POSIX shared memory; the gRPC stream carries only the headers.

Over loopback, moving a block's bytes through gRPC costs several copies and HTTP/2 framing
(~250-350 MB/s here); writing them into a tmpfs segment and letting the receiver map it costs
one copy on each side. A frame then names a segment (`KVFrame.shm`) instead of carrying
`payload`; everything else — the stream, its token, the headers, every check, the
acknowledgement — is unchanged.

Who can read a segment: it is created 0600 by the sender's user in the shared-memory directory
(`/dev/shm` unless configured), so another local user cannot. The receiver opens only names of
this module's form, refuses anything that is not a regular file of its own user with no
group/other access, or whose size differs from the bytes the frame's (already checked) headers
declare, and unlinks the segment once mapped: a segment lives from the sender's write to the
receiver's read, and the sender removes any the receiver never took (a failed or cancelled
stream).

Shared memory is an optimisation, never a requirement: a sender whose write fails (a full
tmpfs, no directory) sends inline, and a receiver that cannot open a segment (another IPC or
mount namespace, another directory) says so (`SegmentUnavailable`), so the sender sends inline
to that peer from then on. A segment's name starts with its writer's pid (``owner_prefix``):
the supervisor of a worker that died removes what it left at once.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import time
from typing import Sequence

from pdserve.services.common.proofs import is_loopback

SHM_DIR = "/dev/shm"
SHARED_MEMORY_MAX_BYTES = 256 << 20   # default cap on one sender's payload bytes in live segments
PREFIX = "pdserve-kv-"
NAME = re.compile(r"pdserve-kv-[0-9]{1,10}-[0-9a-f]{32}")
IOV_MAX = 1024


class SegmentUnavailable(ValueError):
    """The receiver cannot open a segment at all (not there for it: another namespace or
    directory, or no permission): the peers do not share memory, send inline."""


def available(directory: str = SHM_DIR) -> bool:
    return os.path.isdir(directory) and hasattr(os, "writev")


def is_local(target: str) -> bool:
    """Whether a host:port target is this host's loopback (where /dev/shm is shared for sure)."""
    return is_loopback(target.rsplit(":", 1)[0])


def owner_prefix(pid: int) -> str:
    """The start of every segment name the process pid writes."""
    return f"{PREFIX}{pid}-"


def write_segment(payloads: Sequence[memoryview], directory: str = SHM_DIR) -> str:
    """A new segment holding the payloads back to back; returns its name. Raises OSError (a full
    or missing directory); nothing is left behind then."""
    name = f"{owner_prefix(os.getpid())}{secrets.token_hex(16)}"
    fd = os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        for i in range(0, len(payloads), IOV_MAX):
            chunk = payloads[i:i + IOV_MAX]
            want = sum(p.nbytes for p in chunk)
            if os.writev(fd, chunk) != want:   # tmpfs writes whole buffers; anything else is a full directory
                raise OSError(f"short write to shared memory segment {name}")
    except BaseException:
        remove(name, directory)
        raise
    finally:
        os.close(fd)
    return name


def read_segment(name: str, size: int, directory: str = SHM_DIR) -> mmap.mmap:
    """Map a segment a sender named, after checking it is one of ours of exactly size bytes; the
    name is unlinked at once (the mapping stays valid). Raises SegmentUnavailable when it cannot
    be opened, ValueError saying what is wrong with one that can."""
    if not NAME.fullmatch(name):
        raise ValueError(f"not a KV segment name: {name[:80]!r}")
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SegmentUnavailable(f"KV segment {name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"KV segment {name} is not a private file of this user")
        if st.st_size != size:
            raise ValueError(f"KV segment {name} has {st.st_size} bytes, the headers declare {size}")
        if size == 0:
            raise ValueError(f"KV segment {name} is empty")
        return mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        remove(name, directory)


def _segments(directory: str):
    """(name, stat) of this user's segments in directory."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not NAME.fullmatch(name):
            continue
        try:
            st = os.stat(os.path.join(directory, name), follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            yield name, st


def sweep(older_than_s: float, directory: str = SHM_DIR) -> int:
    """Remove this user's segments older than older_than_s (a sender that died between writing a
    segment and the receiver taking it leaves one behind); returns how many went. No live
    transfer is that old: a lease ends every hand-off well before."""
    removed, now = 0, time.time()
    for name, st in list(_segments(directory)):
        if now - st.st_mtime > older_than_s:
            remove(name, directory)
            removed += 1
    return removed


def remove_owned(pid: int, directory: str = SHM_DIR) -> int:
    """Remove every segment the process pid wrote (it is dead: nobody will take them)."""
    prefix = owner_prefix(pid)
    gone = [name for name, _ in _segments(directory) if name.startswith(prefix)]
    for name in gone:
        remove(name, directory)
    return len(gone)


def remove(name: str, directory: str = SHM_DIR) -> None:
    try:
        os.unlink(os.path.join(directory, name))
    except FileNotFoundError:
        pass
