"""One KV block outside the pool (``TierBlock``), and the file the disk tier keeps it in.

A block file is: a header (``HEADER``: magic, format version, the fingerprint of what makes KV
bytes differ, the block's chain hash and its parent hash, its token count and payload length),
the block's token ids (int64), the payload (every layer's K and V, every KV head: the block
shape the KV hand-off carries, so the file does not depend on tensor parallelism), and a MAC of
all that keyed by the tier's secret. ``decode`` checks every one of them against what the lookup
asked for and raises ``RefusedBlock`` on the first that differs; nothing unchecked reaches the pool.

The files are private: directories 0700 and files 0600, owned by the engine's user
(``open_private_dir``, ``create_private``); a file is read only after ``fstat`` says it is a
regular file of ours, private, of exactly the size the lookup expects (``read_checked``: no FIFO
hangs the reader, no symlink to a huge file is read). A file's name is a keyed hash of its chain
hash (``block_file_name``), so a neighbour who knows a prompt can neither name nor forge its block.
The secret (``tier_secret``) is made once per directory and kept there, 0600, so a restarted
engine, or another of the same user on the directory, reads the blocks.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 2   # 2: keyed names and MAC (1: unkeyed; its files sit under another fingerprint, unread)
MAGIC = b"PDKV"
# magic, version, reserved, fingerprint, chain hash, parent hash, token count, payload bytes, padding
# to 64 bytes (token ids and payload then start 8-byte aligned in a buffer read whole)
HEADER = struct.Struct("<4sHH16sQQIQ12x")
DIGEST_BYTES = 32                        # the keyed blake2b MAC at a file's end
FINGERPRINT_BYTES = 16
SECRET_BYTES = 32                        # the tier's key (blake2b takes 16 to 64)
NAME_BYTES = 16                          # a block file's name: this many bytes of keyed hash, in hex
KEY_FILE = "tier.key"                    # the secret, in the tier's root directory
NOT_PRIVATE = stat.S_IRWXG | stat.S_IRWXO
LAYOUT = "layers,kv,block_size,kv_heads,head_dim"   # the payload's dimension order


@dataclass(slots=True)
class TierBlock:
    """A computed prefix block held by a tier: its key, what the key was derived from (the
    parent key and token ids, the prefix cache's collision guard) and its bytes."""

    key: int
    parent: int
    token_ids: tuple[int, ...]
    data: torch.Tensor   # [layers, 2, block_size, kv_heads, head_dim], contiguous, on CPU

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class RefusedBlock(ValueError):
    """A block file that must not be used. keep: it is a sound block of another prefix (a hash
    collision), not a broken or foreign file, so it stays on disk."""

    def __init__(self, reason: str, keep: bool = False) -> None:
        super().__init__(reason)
        self.keep = keep


class UnsafePath(RefusedBlock):
    """A path that is not a private file or directory of ours: a symlink, FIFO or device, another
    user's, readable by others, or (a file) not of the size expected. Refused before any read."""


# ---- private files ------------------------------------------------------------------------------
def check_private(st: os.stat_result, what: str, size: int | None = None) -> None:
    """UnsafePath unless st is ours, with no group or other access, and a directory (size None) or
    a regular file of exactly size bytes."""
    kind = stat.S_ISDIR if size is None else stat.S_ISREG
    if not kind(st.st_mode):
        raise UnsafePath(f"{what} is not a {'directory' if size is None else 'regular file'} "
                         f"(mode {stat.filemode(st.st_mode)})")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{what} is owned by uid {st.st_uid}, not this engine's {os.geteuid()}")
    if st.st_mode & NOT_PRIVATE:
        raise UnsafePath(f"{what} is accessible to group or others (mode {stat.S_IMODE(st.st_mode):04o}, "
                         f"expected {'0700' if size is None else '0600'})")
    if size is not None and st.st_size != size:
        raise UnsafePath(f"{what} has {st.st_size} bytes, expected {size}")


def _open_nofollow(name: str | os.PathLike, flags: int, what: str, dir_fd: int | None = None) -> int:
    """os.open with O_NOFOLLOW: a symlink (or a socket, or a non-directory asked as one) is UnsafePath."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):   # a symlink, a socket, a file not a dir
            raise UnsafePath(f"{what} is a symlink or special file ({os.strerror(exc.errno)})") from None
        raise


def open_private_dir(name: str | os.PathLike, dir_fd: int | None = None, shown: str | None = None) -> int:
    """A descriptor of the directory name (in dir_fd; shown: its path in messages), made 0700 if
    missing; UnsafePath if it is a symlink, not a directory, not ours or accessible to group or
    others (refused, not repaired: another user may have read or planted files in it)."""
    what = f"directory {shown or os.fspath(name)!r}"
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    fd = _open_nofollow(name, os.O_RDONLY | os.O_DIRECTORY, what, dir_fd)
    try:
        check_private(os.fstat(fd), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_checked(name: str, dir_fd: int, size: int, prefix: int | None = None) -> bytearray:
    """The first prefix (default: all size) bytes of the file name in dir_fd, read only once fstat
    says it is a private regular file of ours of exactly size bytes (opened O_NOFOLLOW|O_NONBLOCK:
    a FIFO neither blocks the open nor is read). UnsafePath otherwise; FileNotFoundError if none."""
    fd = _open_nofollow(name, os.O_RDONLY | os.O_NONBLOCK, repr(name), dir_fd)
    try:
        check_private(os.fstat(fd), repr(name), size)
        want = size if prefix is None else min(prefix, size)
        buf = bytearray(want)
        view, got = memoryview(buf), 0
        while got < want:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise UnsafePath(f"{name!r} ended after {got} of its {size} bytes")
            got += n
        return buf
    finally:
        os.close(fd)


def create_private(name: str, dir_fd: int, pieces: list[bytes | memoryview]) -> None:
    """Write pieces to a new file name (0600, O_EXCL|O_NOFOLLOW: never through an existing path) in
    dir_fd; a failed write leaves no file."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
    except BaseException:
        unlink(name, dir_fd)
        raise


def unlink(name: str, dir_fd: int) -> None:
    """Remove name from dir_fd if it is there (a symlink itself, never its target)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def tier_secret(dir_fd: int) -> bytes:
    """The tier's key: KEY_FILE in the private directory dir_fd, made (random, 0600) by the first
    engine there and read with the block files' checks after (UnsafePath if it is not sound)."""
    try:
        return bytes(read_checked(KEY_FILE, dir_fd, SECRET_BYTES))
    except FileNotFoundError:
        pass
    tmp = f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    create_private(tmp, dir_fd, [secrets.token_bytes(SECRET_BYTES)])
    try:   # linked whole into place, never over an existing key: two engines starting at once agree
        os.link(tmp, KEY_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileExistsError:
        pass
    finally:
        unlink(tmp, dir_fd)
    return bytes(read_checked(KEY_FILE, dir_fd, SECRET_BYTES))


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes) or not 16 <= len(secret) <= 64:
        raise ValueError(f"the KV disk tier's secret must be 16 to 64 bytes, got "
                         f"{len(secret) if isinstance(secret, bytes) else type(secret).__name__}")
    return secret


def block_file_name(secret: bytes, key: int) -> str:
    """The file name of the block keyed key: a keyed hash of the chain hash (unguessable without secret)."""
    h = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=NAME_BYTES, key=secret, person=b"pdserve-kvname")
    return h.hexdigest() + ".kv"


def block_mac(secret: bytes) -> "hashlib._Hash":
    """A keyed blake2b over a block file's header, tokens and payload (its last DIGEST_BYTES)."""
    return hashlib.blake2b(digest_size=DIGEST_BYTES, key=secret, person=b"pdserve-kvblock")


def kv_fingerprint(model_dir: str, kv_dtype: str, compute_dtype: str, quantization: str | None,
                   block_shape: tuple[int, ...], kernels: str = "") -> bytes:
    """What makes two engines' KV bytes for the same tokens differ: the checkpoint (its resolved
    path, config.json, and each weight file's name, size and modification time), the KV and
    compute dtypes, the weight quantization, the block shape and layout, the kernels that compute
    it (device, backend, batch-invariant mode: a block from the tier is then bit-identical to a
    recomputed one), the format version. Blocks are only shared between equal fingerprints."""
    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES, person=b"pdserve-kvtier")
    h.update(f"v{FORMAT_VERSION}|{kv_dtype}|{compute_dtype}|{quantization}|{tuple(block_shape)}|{LAYOUT}|"
             f"{kernels}".encode())
    root = Path(model_dir).resolve()
    h.update(str(root).encode())
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        st = path.stat()
        h.update(f"|{path.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.digest()


def file_size(num_tokens: int, payload_bytes: int) -> int:
    return HEADER.size + 8 * num_tokens + payload_bytes + DIGEST_BYTES


def header_key(head: bytes | bytearray, fingerprint: bytes) -> int:
    """The chain hash in a block file's header, if it is a header of this format and fingerprint
    (the rest is checked when the block is read); RefusedBlock otherwise."""
    magic, version, _, file_fp, file_key, *_ = HEADER.unpack_from(head)
    if magic != MAGIC or version != FORMAT_VERSION or file_fp != fingerprint:
        raise RefusedBlock(f"not a version {FORMAT_VERSION} block file of this fingerprint")
    return file_key


def encode(block: TierBlock, fingerprint: bytes, secret: bytes) -> list[bytes | memoryview]:
    """The file's pieces, in order (written one after another; no copy of the payload)."""
    payload = memoryview(block.data.reshape(-1).view(torch.uint8).numpy())
    header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, block.key, block.parent,
                         len(block.token_ids), len(payload))
    tokens = np.asarray(block.token_ids, dtype="<i8").tobytes()
    digest = block_mac(secret)
    for piece in (header, tokens, payload):
        digest.update(piece)
    return [header, tokens, payload, digest.digest()]


def decode(buf: bytearray, fingerprint: bytes, secret: bytes, key: int, parent: int, token_ids: tuple[int, ...],
           shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The payload of a block file read whole into buf, as a tensor of shape and dtype sharing
    buf's memory, if the file is that block of this fingerprint; RefusedBlock otherwise."""
    if len(buf) < HEADER.size + DIGEST_BYTES:
        raise RefusedBlock(f"truncated ({len(buf)} bytes)")
    magic, version, _, file_fp, file_key, file_parent, n_tokens, n_payload = HEADER.unpack_from(buf)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise RefusedBlock(f"not a version {FORMAT_VERSION} block file (magic {magic!r}, version {version})")
    if len(buf) != file_size(n_tokens, n_payload):
        raise RefusedBlock(f"size {len(buf)} does not match its header ({file_size(n_tokens, n_payload)})")
    mac = block_mac(secret)
    mac.update(memoryview(buf)[:-DIGEST_BYTES])
    if not hmac.compare_digest(mac.digest(), bytes(buf[-DIGEST_BYTES:])):
        raise RefusedBlock("MAC mismatch (damaged, or not written with this tier's key)")
    if file_fp != fingerprint:
        raise RefusedBlock(f"written by another model or configuration (fingerprint {file_fp.hex()})")
    if file_key != key:
        raise RefusedBlock(f"holds block {file_key:016x}, not {key:016x}")
    expected = int(np.prod(shape)) * dtype.itemsize
    if n_payload != expected or n_tokens != len(token_ids):
        raise RefusedBlock(f"{n_tokens} tokens and {n_payload} payload bytes, expected {len(token_ids)} and {expected}")
    at = HEADER.size
    file_tokens = np.frombuffer(buf, dtype="<i8", count=n_tokens, offset=at)
    if file_parent != parent or tuple(file_tokens.tolist()) != tuple(token_ids):
        raise RefusedBlock("same chain hash, other parent or tokens (a hash collision)", keep=True)
    at += 8 * n_tokens
    return torch.frombuffer(buf, dtype=dtype, count=expected // dtype.itemsize, offset=at).view(shape)
