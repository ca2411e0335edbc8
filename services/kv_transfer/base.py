"""Transport-neutral KV transfer pieces: the block a sender ships, the stream interface,
and the sink a receiver hands bytes to.

Transports are byte pipes. Sender side: a prefill worker opens one ``KVStream`` per
request (target address + the transfer token from the decode worker's reservation), sends
blocks as chunks complete, heartbeats while it computes, and ``finish()`` waits for the
acknowledgement. Receiver side: the transport parses frames and calls the ``KVSink`` (the
decode engine's KV connector), which owns every check and the request's state: the
transport never decides whether a block is good.

Nothing is pickled: a block travels as a typed header (``pdserve.v1.KVBlockHeader``) plus
its raw bytes.
"""
from __future__ import annotations

import abc
import math
import zlib
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pdserve.engine.kv.handoff import BlockMeta, HandoffError, HandoffState
from pdserve.v1 import kv_pb2

MAX_FRAME_BYTES = 64 << 20           # upper bound accepted for a sender's frame size
DEFAULT_FRAME_BYTES = 4 << 20        # payload bytes per frame, at most (a block larger runs on across frames)
# ... and a frame holds whole blocks up to this many (at least one): small enough that the first
# frame leaves while the rest are built and each stays cheap to copy, large enough that the
# per-frame work (a MAC, a gRPC message) stays small against the bytes
FRAME_TARGET_BYTES = 1 << 20
MAX_PENDING_HEADERS = 4096           # blocks a stream may announce ahead of their bytes

# Wire dtype names (torch names without "torch.").
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


class KVTransferError(Exception):
    """A transfer failed. ``code`` is the gRPC status name that ended it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype, e.g. ``torch.bfloat16`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if SUPPORTED_DTYPES.get(name) is not dtype:
        raise ValueError(f"unsupported KV dtype {dtype}")
    return name


@dataclass(slots=True)
class KVBlock:
    """One block to ship: its identity and its bytes (a CPU tensor)."""

    request_id: str
    block_index: int
    block_hash: int
    data: torch.Tensor
    layer_start: int = 0
    layer_end: int = 0
    head_start: int = 0     # data holds KV heads [head_start, head_end); 0, 0: all (data.shape[3])
    head_end: int = 0

    def encode(self, with_checksum: bool = False) -> tuple[kv_pb2.KVBlockHeader, memoryview]:
        """The block's header and a zero-copy view of its bytes. The transports MAC every frame
        (services/kv_transfer/frames.py), which supersedes a per-block CRC-32: with_checksum
        adds one anyway (checksum 0 means none)."""
        tensor = self.data.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        flat = tensor if tensor.dim() else tensor.reshape(1)
        payload = memoryview(flat.view(torch.uint8).numpy()).cast("B")   # half the cost of reshape(-1) first
        header = kv_pb2.KVBlockHeader(
            request_id=self.request_id, block_index=self.block_index, block_hash=self.block_hash,
            layer_start=self.layer_start, layer_end=self.layer_end or tensor.shape[0],
            dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), nbytes=payload.nbytes,
            checksum=zlib.crc32(payload) & 0xFFFFFFFF if with_checksum else 0, head_start=self.head_start,
            head_end=self.head_end or (self.head_start + tensor.shape[3] if tensor.dim() == 5 else 0))
        return header, payload


def block_meta(header: kv_pb2.KVBlockHeader) -> BlockMeta:
    """The connector's view of a received header. Sizes are checked against the reservation
    (BlockMeta says what the caller claims; nothing is allocated from it here)."""
    shape = tuple(header.shape)
    if len(shape) > 8:
        raise HandoffError("INVALID_ARGUMENT", f"block {header.block_index}: {len(shape)}-dimensional shape")
    # encoded (header.codec set), the block's raw size is raw_nbytes; nbytes is its size on the wire
    field, nbytes = ("raw_nbytes", header.raw_nbytes) if header.codec not in ("", "off") else ("nbytes", header.nbytes)
    if header.dtype in SUPPORTED_DTYPES and nbytes != math.prod(shape) * SUPPORTED_DTYPES[header.dtype].itemsize:
        raise HandoffError("DATA_LOSS", f"block {header.block_index}: {field} {nbytes} != "
                                        f"{header.dtype}{list(shape)}")
    return BlockMeta(header.request_id, header.block_index, header.block_hash, header.dtype, shape, nbytes,
                     header.checksum, header.layer_start, header.layer_end, header.head_start, header.head_end)


class KVSink(Protocol):
    """What a receiving transport calls: the decode engine's KV connector. Each method raises
    HandoffError (its ``code`` is the status the transport answers with)."""

    def authorize(self, request_id: str, token: bytes) -> None: ...
    def heartbeat(self, request_id: str, token: bytes) -> float: ...
    def check(self, meta: BlockMeta, token: bytes) -> object: ...
    def accept(self, meta: BlockMeta, token: bytes, payload: memoryview | bytes | bytearray) -> object: ...
    def fail(self, request_id: str, code: str, message: str) -> bool: ...
    def state(self, request_id: str) -> HandoffState | None: ...


@dataclass(slots=True)
class SendResult:
    blocks: int
    bytes: int                # raw KV bytes acknowledged
    seconds: float
    wire_bytes: int = 0       # their payload bytes on the wire (encoded; 0: not counted by the transport)
    codec: str = "off"        # the stream's wire codec
    streams: int = 1          # connections the transfer's frames went over
    acked_at: float = 0.0     # time.perf_counter() when the receiver's acknowledgement arrived (0: unknown)


class KVStream(abc.ABC):
    """The blocks of one request on their way to one decode worker."""

    # True: cancel() returns only once the stream reads none of its blocks' bytes any more, so its
    # blocks may be views of pinned pool blocks, released right after (AsyncEngine.export_blocks).
    takes_views = False

    @abc.abstractmethod
    async def send(self, blocks: Sequence[KVBlock]) -> None:
        """Queue blocks for sending; returns without waiting for the network."""

    @abc.abstractmethod
    async def heartbeat(self) -> None:
        """Tell the receiver the sender is still working (extends its lease)."""

    @abc.abstractmethod
    async def finish(self, timeout: float | None = None) -> SendResult:
        """Wait until every sent block is acknowledged; raises KVTransferError."""

    @abc.abstractmethod
    async def cancel(self) -> None:
        """Give up: the receiver fails the request and frees its reservation."""


class KVSender(abc.ABC):
    @abc.abstractmethod
    def open(self, target: str, request_id: str, transfer_token: bytes) -> KVStream:
        """Start the request's stream to target (the decode worker's KV address)."""

    async def close(self) -> None:
        """Release transport resources."""
