"""KV block transport over gRPC (``pdserve.v1.KVTransfer/PushBlocks``).

One client-streaming call per ``send_blocks``: for each block a
``KVFrame{header}`` followed by ``header.num_frames`` ``KVFrame{payload}``
frames of at most ``max_frame_bytes`` each. The receiver reassembles each
block into a fresh ``bytearray``, verifies it (see ``base.BlockReceiver``)
and only then passes it to the ``KVSink``.

Channels/servers carrying this service must allow messages of
``grpc_message_limit(max_frame_bytes)`` bytes; use ``kv_grpc_options``.

Fast path: payload frames are by far the bulk of the traffic, so the sender
encodes ``KVFrame{payload}`` by hand (tag + varint + bytes, one copy) and the
receiver registered through ``add_kv_transfer_servicer`` slices the payload
out of the received message without a protobuf parse. Both are byte-for-byte
the standard protobuf wire format, so either side interoperates with plain
generated stubs (the servicer accepts ``KVFrame`` messages too).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

import grpc
import torch

from pdserve.v1 import kv_pb2, kv_pb2_grpc
from services.kv_transfer.base import (
    DEFAULT_MAX_BLOCK_BYTES,
    BlockHeader,
    BlockReceiver,
    KVBlock,
    KVIntegrityError,
    KVSender,
    KVSink,
    KVTransportError,
    ReceiverStats,
    SendResult,
    encode_block,
)

DEFAULT_MAX_FRAME_BYTES = 1 << 20  # 1 MiB payload per frame
MAX_FRAME_BYTES = 64 << 20         # upper bound accepted for max_frame_bytes
FRAME_OVERHEAD_BYTES = 64 << 10    # room for protobuf framing / headers
MAX_ERROR_CHARS = 4096             # cap on PushAck.error


def grpc_message_limit(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """gRPC message size limit needed for frames of ``max_frame_bytes``."""
    return max(4 << 20, max_frame_bytes + FRAME_OVERHEAD_BYTES)


def kv_grpc_options(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[tuple[str, Any]]:
    """Channel/server options raising message limits for KV frames."""
    limit = grpc_message_limit(max_frame_bytes)
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]


_PAYLOAD_TAG = b"\x12"  # KVFrame.payload: field 2, wire type 2 (length-delimited)
_SERVICE = "pdserve.v1.KVTransfer"
_METHOD = f"/{_SERVICE}/PushBlocks"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_payload_frame(chunk: memoryview) -> bytes:
    """Serialized ``KVFrame{payload=chunk}``, built with a single copy."""
    return b"".join((_PAYLOAD_TAG, _varint(chunk.nbytes), chunk))


def _serialize_frame(frame: kv_pb2.KVFrame | bytes) -> bytes:
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


def parse_frame(data: bytes) -> kv_pb2.KVFrame | memoryview:
    """Deserialize a KVFrame; a payload-only frame becomes a zero-copy memoryview."""
    if data[:1] == _PAYLOAD_TAG:
        size, shift, pos = 0, 0, 1
        while pos < len(data) and shift < 64:
            byte = data[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                if pos + size == len(data):
                    return memoryview(data)[pos:]
                break
    return kv_pb2.KVFrame.FromString(data)


def header_to_proto(header: BlockHeader, num_frames: int) -> kv_pb2.KVBlockHeader:
    return kv_pb2.KVBlockHeader(
        request_id=header.request_id,
        block_index=header.block_index,
        block_hash=header.block_hash,
        num_tokens=header.num_tokens,
        layer_start=header.layer_start,
        layer_end=header.layer_end,
        dtype=header.dtype,
        shape=header.shape,
        nbytes=header.nbytes,
        checksum=header.checksum,
        num_frames=num_frames,
    )


def header_from_proto(msg: kv_pb2.KVBlockHeader) -> BlockHeader:
    return BlockHeader(
        request_id=msg.request_id,
        block_index=msg.block_index,
        block_hash=msg.block_hash,
        num_tokens=msg.num_tokens,
        layer_start=msg.layer_start,
        layer_end=msg.layer_end,
        dtype=msg.dtype,
        shape=tuple(msg.shape),
        nbytes=msg.nbytes,
        checksum=msg.checksum,
    )


def num_frames_for(nbytes: int, max_frame_bytes: int) -> int:
    return -(-nbytes // max_frame_bytes)


def encode_frames(block: KVBlock, max_frame_bytes: int) -> tuple[BlockHeader, list[kv_pb2.KVFrame]]:
    """Encode one block into its header and payload frames (eager; for tests/tools)."""
    header, payload = encode_block(block)
    frames = [kv_pb2.KVFrame(header=header_to_proto(header, num_frames_for(header.nbytes, max_frame_bytes)))]
    for off in range(0, header.nbytes, max_frame_bytes):
        frames.append(kv_pb2.KVFrame(payload=payload[off : off + max_frame_bytes].tobytes()))
    return header, frames


def _encode_soon(block: KVBlock) -> asyncio.Future[tuple[BlockHeader, memoryview]]:
    """``encode_block`` in the default executor for device tensors, else inline.

    Device->host copies (and their CRC) then overlap with streaming the
    previous block; for host data a thread hop measured as pure overhead.
    """
    loop = asyncio.get_running_loop()
    data = block.data
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        return loop.run_in_executor(None, encode_block, block)
    fut: asyncio.Future[tuple[BlockHeader, memoryview]] = loop.create_future()
    try:
        fut.set_result(encode_block(block))
    except Exception as exc:
        fut.set_exception(exc)
    return fut


def _discard(fut: asyncio.Future) -> None:
    """Drop a prefetch future without 'exception never retrieved' warnings."""
    if fut.done():
        if not fut.cancelled():
            fut.exception()
    else:
        fut.cancel()


class GrpcKVSender(KVSender):
    """grpc.aio client for ``KVTransfer.PushBlocks``; one cached channel per target.

    Use from a single event loop (grpc.aio channels are loop-bound).
    """

    def __init__(
        self,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if not 0 < max_frame_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"max_frame_bytes must be in (0, {MAX_FRAME_BYTES}]")
        super().__init__()
        self.max_frame_bytes = max_frame_bytes
        self._options = [*kv_grpc_options(max_frame_bytes), *channel_options]
        self._channels: dict[str, tuple[grpc.aio.Channel, grpc.aio.StreamUnaryMultiCallable]] = {}

    def _push_blocks(self, target: str) -> grpc.aio.StreamUnaryMultiCallable:
        entry = self._channels.get(target)
        if entry is None:
            channel = grpc.aio.insecure_channel(target, options=self._options)
            method = channel.stream_unary(
                _METHOD,
                request_serializer=_serialize_frame,
                response_deserializer=kv_pb2.PushAck.FromString,
            )
            entry = self._channels[target] = (channel, method)
        return entry[1]

    async def send_blocks(
        self, target: str, blocks: Sequence[KVBlock], *, timeout: float | None = None
    ) -> SendResult:
        self.check_blocks(blocks)
        stats = self.stats
        stats.send_calls += 1
        if not blocks:
            return SendResult(blocks=0, bytes=0, seconds=0.0)
        start = time.perf_counter()
        step = self.max_frame_bytes
        call = self._push_blocks(target)(timeout=timeout)
        # Encode one block ahead (in a worker thread for device tensors).
        ahead = _encode_soon(blocks[0])
        try:
            for i in range(len(blocks)):
                header, payload = await ahead
                if i + 1 < len(blocks):
                    ahead = _encode_soon(blocks[i + 1])
                n_frames = num_frames_for(header.nbytes, step)
                await call.write(kv_pb2.KVFrame(header=header_to_proto(header, n_frames)))
                for off in range(0, header.nbytes, step):
                    await call.write(encode_payload_frame(payload[off : off + step]))
                stats.blocks_sent += 1
                stats.bytes_sent += header.nbytes
            await call.done_writing()
            ack: kv_pb2.PushAck = await call
        except grpc.aio.AioRpcError as exc:
            stats.failures += 1
            raise KVTransportError(
                f"PushBlocks to {target} failed: {exc.code().name}: {exc.details()}"
            ) from exc
        except BaseException:
            stats.failures += 1
            call.cancel()
            raise
        finally:
            _discard(ahead)
            stats.seconds += time.perf_counter() - start
        stats.blocks_rejected += len(ack.rejected_block_indices)
        return SendResult(
            blocks=ack.blocks_received,
            bytes=ack.bytes_received,
            seconds=time.perf_counter() - start,
            rejected=list(ack.rejected_block_indices),
            error=ack.error,
        )

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            await channel.close()


@dataclass(slots=True)
class _Pending:
    """A block whose payload frames are still arriving."""

    header: BlockHeader
    num_frames: int
    buf: bytearray | None  # None: already rejected, frames are skipped
    offset: int = 0
    frames: int = 0


class _PushState:
    """Per-stream reassembly state and ack bookkeeping."""

    def __init__(self, receiver: BlockReceiver) -> None:
        self.rx = receiver
        self.request_id: str | None = None
        self.pending: _Pending | None = None
        self.orphan = False  # inside a run of payload frames without header
        self.accepted = 0
        self.accepted_bytes = 0
        self.rejected: list[int] = []
        self.errors: list[str] = []

    def reject(self, block_index: int, reason: Exception | str) -> None:
        self.rejected.append(block_index)
        self.errors.append(self.rx.reject(block_index, reason))

    def protocol_error(self, message: str) -> None:
        self.rx.stats.failures += 1
        self.errors.append(f"stream: {message}")

    def on_header(self, msg: kv_pb2.KVBlockHeader) -> None:
        self.orphan = False
        if self.pending is not None:
            p = self.pending
            self.pending = None
            if p.buf is not None:
                self.reject(p.header.block_index, f"only {p.frames} of {p.num_frames} frames arrived")
        header = header_from_proto(msg)
        if self.request_id is None:
            self.request_id = header.request_id
        pending = _Pending(header=header, num_frames=msg.num_frames, buf=None)
        try:
            if header.request_id != self.request_id:
                raise KVIntegrityError(
                    f"request_id {header.request_id!r} != stream's {self.request_id!r}"
                )
            if (header.nbytes == 0) != (msg.num_frames == 0) or msg.num_frames > header.nbytes:
                raise KVIntegrityError(f"{msg.num_frames} frames for {header.nbytes} bytes")
            self.rx.check_header(header)
            pending.buf = bytearray(header.nbytes)
        except KVIntegrityError as exc:
            self.reject(header.block_index, exc)
        self.pending = pending

    def on_payload(self, data: bytes | memoryview) -> None:
        p = self.pending
        if p is None:
            if not self.orphan:
                self.orphan = True
                self.protocol_error("payload frame without a header")
            return
        p.frames += 1
        if p.buf is not None:
            end = p.offset + len(data)
            if end > len(p.buf):
                p.buf = None
                self.reject(p.header.block_index, f"payload exceeds nbytes {p.header.nbytes}")
            else:
                p.buf[p.offset : end] = data
                p.offset = end

    def take_complete(self) -> _Pending | None:
        """Pop the pending block if all its frames arrived."""
        p = self.pending
        if p is not None and p.frames >= p.num_frames:
            self.pending = None
            return p
        return None

    async def finish(self, p: _Pending) -> None:
        if p.buf is None:
            return  # rejected earlier
        reason = await self.rx.deliver(p.header, p.buf)
        if reason is None:
            self.accepted += 1
            self.accepted_bytes += p.header.nbytes
        else:
            self.rejected.append(p.header.block_index)
            self.errors.append(reason)

    def end_of_stream(self) -> None:
        p = self.pending
        self.pending = None
        if p is not None and p.buf is not None:
            self.reject(p.header.block_index, f"stream ended after {p.frames} of {p.num_frames} frames")

    def ack(self) -> kv_pb2.PushAck:
        return kv_pb2.PushAck(
            blocks_received=self.accepted,
            bytes_received=self.accepted_bytes,
            rejected_block_indices=self.rejected,
            error="; ".join(self.errors)[:MAX_ERROR_CHARS],
        )


class KVTransferServicer(kv_pb2_grpc.KVTransferServicer):
    """grpc.aio servicer: reassemble, verify, deliver to a KVSink (fail closed)."""

    def __init__(self, sink: KVSink, *, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> None:
        self.receiver = BlockReceiver(sink, max_block_bytes=max_block_bytes)

    @property
    def stats(self) -> ReceiverStats:
        return self.receiver.stats

    async def PushBlocks(
        self, request_iterator: AsyncIterator[kv_pb2.KVFrame], context: grpc.aio.ServicerContext
    ) -> kv_pb2.PushAck:
        state = _PushState(self.receiver)
        self.stats.streams += 1
        start = time.perf_counter()
        try:
            async for frame in request_iterator:
                if isinstance(frame, memoryview):  # fast-path payload frame
                    state.on_payload(frame)
                else:
                    kind = frame.WhichOneof("frame")
                    if kind == "header":
                        state.on_header(frame.header)
                    elif kind == "payload":
                        state.on_payload(frame.payload)
                    else:
                        state.protocol_error("empty frame")
                done = state.take_complete()
                if done is not None:
                    await state.finish(done)
            state.end_of_stream()
            return state.ack()
        finally:
            self.stats.seconds += time.perf_counter() - start


def add_kv_transfer_servicer(
    server: grpc.aio.Server, sink: KVSink, *, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES
) -> KVTransferServicer:
    """Register a KVTransferServicer (with the fast frame parser) on ``server``.

    Create the server with ``options=kv_grpc_options(max_frame_bytes)``.
    """
    servicer = KVTransferServicer(sink, max_block_bytes=max_block_bytes)
    register_kv_servicer(servicer, server)
    return servicer


def register_kv_servicer(servicer: KVTransferServicer, server: grpc.aio.Server) -> None:
    """Like ``kv_pb2_grpc.add_KVTransferServicer_to_server`` but with ``parse_frame``."""
    handlers = {
        "PushBlocks": grpc.stream_unary_rpc_method_handler(
            servicer.PushBlocks,
            request_deserializer=parse_frame,
            response_serializer=kv_pb2.PushAck.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)
