"""A KV stream's wire codec (kv.proto's ``KVBlockHeader.codec``): the prefill side's choice per
decode target (``--kv-compression``), each block's encode before it is framed (and MACed: the MAC
covers the bytes on the wire), and the receiver's checks and decode.

``auto`` (the prefill worker's default) chooses between ``off`` and ``lossless`` per decode target:
the first stream to a target goes ``off``; each stream's send phase (seconds the writer was busy,
plus the wait for the acknowledgement) feeds that target's LinkEstimator, and later streams take
``compression.choose(rate, costs)``, with the codec's costs measured once per block geometry on the
first block that needs them. ``int8`` (lossy) is used only when asked; a dtype it cannot take goes
lossless. Shared-memory frames are never encoded (same host). Receivers decode any codec they know,
whatever their own flag.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from pdserve.engine.kv.handoff import BlockMeta, HandoffError
from pdserve.v1 import kv_pb2
from pdserve.services.kv_transfer import compression
from pdserve.services.kv_transfer.base import KVBlock, block_meta

MODES = ("auto", *compression.CODECS)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"kv_compression must be one of {MODES}, got {mode!r}")
    return mode


# ---- sender --------------------------------------------------------------------------------------
def encode_block(block: KVBlock, codec: str) -> tuple[kv_pb2.KVBlockHeader, memoryview | bytes]:
    """The block's header and wire payload under codec. ``int8`` on a dtype (or values) it cannot
    take goes lossless; an encoding no smaller than the raw bytes goes ``off`` (header.codec unset)."""
    header, payload = block.encode()
    if codec == "off":
        return header, payload
    shape = tuple(header.shape)
    try:
        enc = compression.encode(payload, header.dtype, shape, codec)
    except ValueError:
        if codec != "int8":
            raise
        enc = compression.encode(payload, header.dtype, shape, "lossless")
    if enc.nbytes >= payload.nbytes:
        return header, payload
    header.codec, header.raw_nbytes, header.nbytes = enc.codec, header.nbytes, enc.nbytes
    return header, enc.data


def encode_blocks(blocks: Sequence[KVBlock], codec: str) -> list[tuple[kv_pb2.KVBlockHeader, memoryview | bytes]]:
    return [encode_block(b, codec) for b in blocks]


class CodecPolicy:
    """The prefill side's codec per decode target (see the module docstring); thread-safe."""

    def __init__(self, mode: str = "off", margin: float = 0.1) -> None:
        self.mode = check_mode(mode)
        self.margin = margin
        self._links: dict[str, compression.LinkEstimator] = {}
        self._costs: dict[tuple[str, tuple[int, ...]], compression.CodecCosts] = {}
        self._lock = threading.Lock()

    def link(self, target: str) -> compression.LinkEstimator:
        """Target's link estimator (created empty on first use)."""
        with self._lock:
            return self._links.setdefault(target, compression.LinkEstimator())

    def observe(self, target: str, wire_bytes: int, seconds: float) -> None:
        """A finished stream's send phase to target: wire_bytes in seconds."""
        self.link(target).observe(wire_bytes, seconds)

    def costs(self, block: KVBlock) -> compression.CodecCosts:
        """The lossless codec's measured cost on this block's geometry (measured once, on block)."""
        header, payload = block.encode()
        key = (header.dtype, tuple(header.shape))
        with self._lock:
            known = self._costs.get(key)
        if known is None:
            known = compression.measure_costs(payload, header.dtype, key[1], codecs=("lossless",))
            with self._lock:
                self._costs.setdefault(key, known)
        return known

    def pick(self, target: str, sample: KVBlock) -> str:
        """The codec of a new stream to target, whose first block is sample (CPU work: off the loop)."""
        if self.mode != "auto":
            return self.mode
        rate = self.link(target).rate
        if rate is None:
            return "off"
        return compression.choose(rate, self.costs(sample), margin=self.margin)


# ---- receiver ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WireMeta:
    """A received header: the block as the connector sees it (raw size), its codec, its wire size."""
    meta: BlockMeta
    codec: str = "off"
    nbytes: int = 0


def wire_meta(header: kv_pb2.KVBlockHeader) -> WireMeta:
    """Header checked before anything is allocated: a known codec (INVALID_ARGUMENT naming
    header.codec), the raw size against dtype and shape (block_meta), the wire size against the
    codec's bound for it (INVALID_ARGUMENT naming header.nbytes)."""
    codec = header.codec or "off"
    if codec not in compression.CODECS:
        raise HandoffError("INVALID_ARGUMENT", f"block {header.block_index}: header.codec {header.codec!r} is not one "
                                               f"of {compression.CODECS}")
    meta = block_meta(header)
    if codec == "off":
        return WireMeta(meta, codec, meta.nbytes)
    try:
        limit = compression.max_encoded_nbytes(codec, header.dtype, tuple(header.shape))
    except ValueError as exc:
        raise HandoffError("INVALID_ARGUMENT", f"block {header.block_index}: header.codec {codec!r}: {exc}") from None
    if header.nbytes > limit:
        raise HandoffError("INVALID_ARGUMENT", f"block {header.block_index}: header.nbytes {header.nbytes} exceeds "
                                               f"{limit}, the {codec} limit for raw_nbytes {meta.nbytes}")
    return WireMeta(meta, codec, header.nbytes)


def decode_payload(wire: WireMeta, payload: memoryview | bytes | bytearray) -> memoryview | bytes | bytearray:
    """The block's raw bytes (exactly meta.nbytes) from its wire payload; DATA_LOSS on any codec error."""
    if wire.codec == "off":
        return payload
    meta = wire.meta
    try:
        return compression.decode(payload, wire.codec, meta.dtype, meta.shape, meta.nbytes)
    except ValueError as exc:
        raise HandoffError("DATA_LOSS", f"block {meta.block_index}: header.codec {wire.codec!r}: {exc}") from None
