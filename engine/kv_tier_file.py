"""One KV block outside the pool (``TierBlock``), and the file the disk tier keeps it in.

A block file is: a header (``HEADER``: magic, format version, the fingerprint of what makes KV
bytes differ, the block's chain hash and its parent hash, its token count and payload length),
the block's token ids (int64), the payload (every layer's K and V, every KV head: the block
shape the KV hand-off carries, so the file does not depend on tensor parallelism), and a
blake2b digest of all that. ``decode`` checks every one of them against what the lookup asked
for and raises ``RefusedBlock`` on the first that differs; nothing unchecked reaches the pool.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
MAGIC = b"PDKV"
# magic, version, reserved, fingerprint, chain hash, parent hash, token count, payload bytes, padding
# to 64 bytes (token ids and payload then start 8-byte aligned in a buffer read whole)
HEADER = struct.Struct("<4sHH16sQQIQ12x")
DIGEST_BYTES = 16
FINGERPRINT_BYTES = 16
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


def encode(block: TierBlock, fingerprint: bytes) -> list[bytes | memoryview]:
    """The file's pieces, in order (written one after another; no copy of the payload)."""
    payload = memoryview(block.data.reshape(-1).view(torch.uint8).numpy())
    header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, block.key, block.parent,
                         len(block.token_ids), len(payload))
    tokens = np.asarray(block.token_ids, dtype="<i8").tobytes()
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for piece in (header, tokens, payload):
        digest.update(piece)
    return [header, tokens, payload, digest.digest()]


def decode(buf: bytearray, fingerprint: bytes, key: int, parent: int, token_ids: tuple[int, ...],
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
    body = memoryview(buf)[:-DIGEST_BYTES]
    if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != bytes(buf[-DIGEST_BYTES:]):
        raise RefusedBlock("checksum mismatch")
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
