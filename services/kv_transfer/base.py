"""Transport-neutral KV block types, header encode/verify and interfaces.

Everything here is independent of gRPC so that another transport (e.g. one
through Ray's object store) can reuse the same header, hash and checksum
rules:

* Sender side: ``encode_block(block)`` -> ``(BlockHeader, payload)`` where the
  payload is a flat ``memoryview`` of the block's raw bytes (no pickle) and
  ``header.checksum`` is its CRC-32.
* Receiver side: ``BlockReceiver`` runs ``check_header`` before allocating,
  ``verify_payload`` after reassembly, and only then hands the bytes to a
  ``KVSink`` (fail closed). ``decode_tensor`` rebuilds the tensor.
"""

from __future__ import annotations

import abc
import inspect
import math
import zlib
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Protocol, Sequence, Union

import torch

# Payload types a KVBlock may carry. Tensors may live on any device.
BlockData = Union[bytes, bytearray, memoryview, torch.Tensor]

DEFAULT_MAX_BLOCK_BYTES = 256 << 20  # Receiver-side cap on a single block.

# Wire dtype names (torch names without "torch.") accepted on both sides.
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


class KVTransferError(Exception):
    """Base class for KV transport errors."""


class KVIntegrityError(KVTransferError):
    """A block failed a header, size, checksum or hash check."""


class KVTransportError(KVTransferError):
    """The transport itself failed (connection, RPC error, timeout)."""


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype, e.g. ``torch.bfloat16`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if SUPPORTED_DTYPES.get(name) is not dtype:
        raise ValueError(f"unsupported KV dtype {dtype}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises KVIntegrityError if unknown."""
    try:
        return SUPPORTED_DTYPES[name]
    except KeyError:
        raise KVIntegrityError(f"unsupported dtype {name!r}") from None


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """CRC-32 (IEEE, as zlib.crc32/gzip) of the payload bytes, as uint32."""
    return zlib.crc32(data) & 0xFFFFFFFF


def expected_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Byte size of a C-contiguous tensor of ``dtype`` and ``shape``."""
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """Metadata that travels with every block (mirrors ``KVBlockHeader``)."""

    request_id: str
    block_index: int
    block_hash: int
    num_tokens: int
    layer_start: int
    layer_end: int
    dtype: str  # wire name, see SUPPORTED_DTYPES
    shape: tuple[int, ...]
    nbytes: int
    checksum: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass(slots=True)
class KVBlock:
    """One KV-cache block to ship: metadata plus raw data.

    ``data`` is either a tensor (any device; its dtype/shape must match) or a
    bytes-like object holding exactly ``prod(shape) * dtype.itemsize`` bytes.
    """

    request_id: str
    block_index: int
    block_hash: int
    num_tokens: int
    layer_start: int
    layer_end: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: BlockData

    @classmethod
    def from_tensor(
        cls,
        tensor: torch.Tensor,
        *,
        request_id: str,
        block_index: int,
        block_hash: int,
        num_tokens: int,
        layer_start: int = 0,
        layer_end: int = 0,
    ) -> "KVBlock":
        """Build a block whose dtype and shape come from ``tensor``."""
        return cls(
            request_id=request_id,
            block_index=block_index,
            block_hash=block_hash,
            num_tokens=num_tokens,
            layer_start=layer_start,
            layer_end=layer_end,
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            data=tensor,
        )

    def validate(self) -> None:
        """Cheap consistency checks (no data copy); raises ValueError."""
        dtype_name(self.dtype)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        if not 0 <= self.layer_start <= self.layer_end:
            raise ValueError(f"bad layer range [{self.layer_start}, {self.layer_end})")
        if isinstance(self.data, torch.Tensor):
            if self.data.dtype != self.dtype or tuple(self.data.shape) != self.shape:
                raise ValueError(
                    f"tensor {self.data.dtype}{tuple(self.data.shape)} does not "
                    f"match block {self.dtype}{self.shape}"
                )
        else:
            size = memoryview(self.data).nbytes
            want = expected_nbytes(self.dtype, self.shape)
            if size != want:
                raise ValueError(f"block data has {size} bytes, expected {want}")


def block_payload(block: KVBlock) -> memoryview:
    """Flat uint8 view of the block's bytes (zero-copy for CPU tensors)."""
    data = block.data
    if isinstance(data, torch.Tensor):
        tensor = data.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        return memoryview(flat.numpy())  # keeps the tensor storage alive
    return memoryview(data).cast("B")


def encode_block(block: KVBlock) -> tuple[BlockHeader, memoryview]:
    """Validate a block and produce its header (with checksum) and payload."""
    block.validate()
    payload = block_payload(block)
    header = BlockHeader(
        request_id=block.request_id,
        block_index=block.block_index,
        block_hash=block.block_hash,
        num_tokens=block.num_tokens,
        layer_start=block.layer_start,
        layer_end=block.layer_end,
        dtype=dtype_name(block.dtype),
        shape=tuple(block.shape),
        nbytes=payload.nbytes,
        checksum=block_checksum(payload),
    )
    return header, payload


def check_header(header: BlockHeader, *, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> None:
    """Receiver-side header sanity checks, run before allocating the payload."""
    dtype = dtype_from_name(header.dtype)
    if not header.request_id:
        raise KVIntegrityError("empty request_id")
    if header.layer_start > header.layer_end:
        raise KVIntegrityError(f"bad layer range [{header.layer_start}, {header.layer_end})")
    if header.nbytes > max_block_bytes:
        raise KVIntegrityError(f"block of {header.nbytes} bytes exceeds limit {max_block_bytes}")
    want = expected_nbytes(dtype, header.shape)
    if header.nbytes != want:
        raise KVIntegrityError(
            f"nbytes {header.nbytes} != {header.dtype}{list(header.shape)} size {want}"
        )


def verify_payload(header: BlockHeader, payload: bytes | bytearray | memoryview) -> None:
    """Check payload length and CRC-32 against the header."""
    size = memoryview(payload).nbytes
    if size != header.nbytes:
        raise KVIntegrityError(f"payload has {size} bytes, header says {header.nbytes}")
    crc = block_checksum(payload)
    if crc != header.checksum:
        raise KVIntegrityError(f"checksum mismatch: header {header.checksum:#010x}, payload {crc:#010x}")


def decode_tensor(header: BlockHeader, payload: bytes | bytearray | memoryview) -> torch.Tensor:
    """Rebuild the block tensor from verified bytes (shares ``payload`` memory).

    Pass a writable buffer (bytearray) to avoid torch's read-only warning.
    """
    dtype = dtype_from_name(header.dtype)
    if header.nbytes == 0:
        return torch.empty(header.shape, dtype=dtype)
    raw = torch.frombuffer(payload, dtype=torch.uint8, count=header.nbytes)
    return raw.view(dtype).reshape(header.shape)


class KVSink(Protocol):
    """Receiving end of a transport: usually the decode worker's KV cache.

    Called only with verified bytes; the sink takes ownership of ``payload``.
    It may additionally check ``header.block_hash`` / ``request_id`` against
    its reservation and raise :class:`KVIntegrityError` (or any
    :class:`KVTransferError`) to reject the block. May be sync or async;
    sync implementations run on the event loop and should be quick.
    """

    def accept_block(self, header: BlockHeader, payload: bytearray) -> None | Awaitable[None]: ...


@dataclass(slots=True)
class SendResult:
    """Outcome of one ``send_blocks`` call.

    ``blocks``/``bytes`` count what the receiver accepted; ``rejected`` lists
    the block indices it refused.
    """

    blocks: int
    bytes: int
    seconds: float
    rejected: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.rejected


@dataclass(slots=True)
class SenderStats:
    """Cumulative sender counters."""

    bytes_sent: int = 0       # payload bytes written to the transport
    blocks_sent: int = 0      # blocks written to the transport
    blocks_rejected: int = 0  # blocks the receiver refused
    send_calls: int = 0
    failures: int = 0         # send_blocks calls that raised
    seconds: float = 0.0      # wall time inside send_blocks

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(slots=True)
class ReceiverStats:
    """Cumulative receiver counters."""

    bytes_received: int = 0   # payload bytes of accepted blocks
    blocks_received: int = 0  # blocks accepted by the sink
    blocks_rejected: int = 0  # blocks failing checks or refused by the sink
    streams: int = 0          # transport streams/calls handled
    failures: int = 0         # protocol errors (malformed streams)
    seconds: float = 0.0      # wall time spent receiving

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class KVSender(abc.ABC):
    """Ships KV blocks of one request to a receiver at ``target``."""

    def __init__(self) -> None:
        self.stats = SenderStats()

    @abc.abstractmethod
    async def send_blocks(
        self, target: str, blocks: Sequence[KVBlock], *, timeout: float | None = None
    ) -> SendResult:
        """Send ``blocks`` (all of one request); raise KVTransferError on failure."""

    async def close(self) -> None:
        """Release transport resources."""

    async def __aenter__(self) -> "KVSender":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @staticmethod
    def check_blocks(blocks: Sequence[KVBlock]) -> None:
        """Validate blocks up front: one request id, consistent metadata."""
        request_ids = {b.request_id for b in blocks}
        if len(request_ids) > 1:
            raise ValueError(f"send_blocks takes blocks of one request, got {sorted(request_ids)}")
        for block in blocks:
            block.validate()


class BlockReceiver:
    """Transport-neutral receive path: verify, then deliver to a sink."""

    def __init__(self, sink: KVSink, *, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> None:
        self.sink = sink
        self.max_block_bytes = max_block_bytes
        self.stats = ReceiverStats()

    def check_header(self, header: BlockHeader) -> None:
        check_header(header, max_block_bytes=self.max_block_bytes)

    async def deliver(self, header: BlockHeader, payload: bytearray) -> str | None:
        """Verify and hand over one block; return a rejection reason or None."""
        try:
            self.check_header(header)
            verify_payload(header, payload)
            result = self.sink.accept_block(header, payload)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # fail closed: any error rejects the block
            return self.reject(header.block_index, exc)
        self.stats.blocks_received += 1
        self.stats.bytes_received += header.nbytes
        return None

    def reject(self, block_index: int, reason: Exception | str) -> str:
        """Count a rejected block and format its reason."""
        self.stats.blocks_rejected += 1
        if isinstance(reason, Exception) and not isinstance(reason, KVTransferError):
            reason = f"{type(reason).__name__}: {reason}"
        return f"block {block_index}: {reason}"
