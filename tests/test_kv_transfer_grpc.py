"""KV block transport over a real grpc.aio server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

import grpc
import pytest
import torch

from pdserve.v1 import kv_pb2, kv_pb2_grpc
from services.kv_transfer import (
    BlockHeader,
    GrpcKVSender,
    KVBlock,
    KVIntegrityError,
    KVTransferServicer,
    KVTransportError,
    decode_tensor,
    kv_grpc_options,
)
from services.kv_transfer.grpc_transport import (
    encode_frames,
    encode_payload_frame,
    parse_frame,
    register_kv_servicer,
)

MiB = 1 << 20


class StoreSink:
    """Test sink: keeps every accepted block, can refuse chosen indices."""

    def __init__(self, refuse: set[int] = frozenset()) -> None:
        self.blocks: dict[tuple[str, int], tuple[BlockHeader, bytearray]] = {}
        self.refuse = refuse

    def accept_block(self, header: BlockHeader, payload: bytearray) -> None:
        if header.block_index in self.refuse:
            raise KVIntegrityError(f"unexpected block_hash {header.block_hash}")
        self.blocks[(header.request_id, header.block_index)] = (header, payload)


class RecordingServicer(KVTransferServicer):
    """Records (kind, size) of each incoming frame before normal handling."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.frames: list[tuple[str, int]] = []

    async def PushBlocks(self, request_iterator, context):  # type: ignore[override]
        async def tap() -> AsyncIterator[kv_pb2.KVFrame]:
            async for frame in request_iterator:
                if isinstance(frame, memoryview):  # fast-path payload frame
                    self.frames.append(("payload", frame.nbytes))
                elif frame.WhichOneof("frame") == "header":
                    self.frames.append(("header", frame.header.num_frames))
                else:
                    self.frames.append(("payload", len(frame.payload)))
                yield frame

        return await super().PushBlocks(tap(), context)


@asynccontextmanager
async def kv_server(
    sink: StoreSink, fast: bool = True, **kwargs
) -> AsyncIterator[tuple[str, RecordingServicer]]:
    """Server with the fast frame parser, or the plain generated registration."""
    server = grpc.aio.server(options=kv_grpc_options())
    servicer = RecordingServicer(sink, **kwargs)
    if fast:
        register_kv_servicer(servicer, server)
    else:
        kv_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(grace=None)


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout=60))


def make_block(index: int, dtype: torch.dtype, shape: tuple[int, ...], rid: str = "req-1") -> KVBlock:
    gen = torch.Generator().manual_seed(index)
    tensor = torch.randn(shape, generator=gen).to(dtype)
    return KVBlock.from_tensor(
        tensor,
        request_id=rid,
        block_index=index,
        block_hash=0xABCDEF0123456789 + index,
        num_tokens=shape[2] if len(shape) > 2 else 1,
        layer_start=0,
        layer_end=shape[0],
    )


def assert_arrived(sink: StoreSink, block: KVBlock) -> None:
    header, payload = sink.blocks[(block.request_id, block.block_index)]
    assert header.block_hash == block.block_hash
    assert header.num_tokens == block.num_tokens
    assert (header.layer_start, header.layer_end) == (block.layer_start, block.layer_end)
    got = decode_tensor(header, payload)
    want = block.data
    assert isinstance(want, torch.Tensor)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert bytes(payload) == want.contiguous().view(torch.uint8).numpy().tobytes()
    assert torch.equal(got, want)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-parser", "generated-stub"])
def test_roundtrip_dtypes_and_multiframe(fast: bool) -> None:
    blocks = [
        make_block(0, torch.float32, (2, 2, 16, 4, 32)),
        make_block(1, torch.bfloat16, (2, 2, 16, 4, 32)),
        make_block(2, torch.float16, (2, 2, 16, 4, 32)),
        make_block(3, torch.float32, (33, 2, 16, 8, 128)),  # 4.125 MiB -> 5 frames
    ]
    raw = bytes(range(256)) * 4
    blocks.append(
        KVBlock("req-1", 4, 99, 16, 0, 1, torch.bfloat16, (2, 256), raw)  # bytes payload
    )

    async def body() -> None:
        sink = StoreSink()
        async with kv_server(sink, fast) as (addr, servicer), GrpcKVSender() as sender:
            result = await sender.send_blocks(addr, blocks, timeout=30)
            assert result.ok and result.rejected == [] and result.error == ""
            assert result.blocks == len(blocks)
            total = sum(len(sink.blocks[("req-1", b.block_index)][1]) for b in blocks)
            assert result.bytes == total and total > 4 * MiB
            for block in blocks[:4]:
                assert_arrived(sink, block)
            assert bytes(sink.blocks[("req-1", 4)][1]) == raw
            # Frames: big block split into 5 frames of <= 1 MiB.
            payloads = [size for kind, size in servicer.frames if kind == "payload"]
            assert max(payloads) <= MiB
            assert ("header", 5) in servicer.frames
            assert sender.stats.blocks_sent == len(blocks)
            assert sender.stats.bytes_sent == total and sender.stats.failures == 0
            rx = servicer.stats
            assert (rx.blocks_received, rx.bytes_received, rx.blocks_rejected) == (len(blocks), total, 0)
            assert rx.streams == 1 and rx.failures == 0

    run(body)


def test_frames_respect_max_frame_bytes() -> None:
    max_frame = 64 << 10
    block = make_block(0, torch.float32, (8, 2, 16, 8, 65))  # 532480 bytes = 8.125 frames

    async def body() -> None:
        sink = StoreSink()
        async with kv_server(sink) as (addr, servicer), GrpcKVSender(max_frame_bytes=max_frame) as sender:
            result = await sender.send_blocks(addr, [block])
            assert result.ok
            assert_arrived(sink, block)
            assert servicer.frames[0] == ("header", 9)
            sizes = [size for kind, size in servicer.frames[1:]]
            assert sizes == [max_frame] * 8 + [532480 - 8 * max_frame]

    run(body)


def test_payload_frame_fast_path_matches_protobuf() -> None:
    for size in (1, 127, 128, 16383, 16384, (1 << 20) + 3):
        chunk = memoryview(bytes(range(256)) * (size // 256 + 1))[:size]
        wire = encode_payload_frame(chunk)
        assert wire == kv_pb2.KVFrame(payload=chunk.tobytes()).SerializeToString()
        parsed = parse_frame(wire)
        assert isinstance(parsed, memoryview) and parsed == chunk
    header = kv_pb2.KVFrame(header=kv_pb2.KVBlockHeader(request_id="r", nbytes=4))
    assert parse_frame(header.SerializeToString()) == header
    # Payload followed by another field: not the fast shape, parsed by protobuf.
    odd = encode_payload_frame(memoryview(b"abcd")) + kv_pb2.KVFrame(payload=b"xy").SerializeToString()
    assert parse_frame(odd) == kv_pb2.KVFrame(payload=b"xy")


def test_corrupted_and_malformed_blocks_are_rejected() -> None:
    """Fail closed: corrupted, truncated, oversized or refused blocks never reach the sink."""
    frame_bytes = 32 << 10
    good = make_block(0, torch.bfloat16, (2, 2, 16, 4, 64))
    flipped = make_block(1, torch.float32, (2, 2, 16, 4, 64))
    bad_crc = make_block(2, torch.float16, (2, 2, 16, 4, 64))
    truncated = make_block(3, torch.float32, (2, 2, 16, 4, 64))
    refused = make_block(4, torch.float32, (1, 2, 16, 4, 64))
    too_big = make_block(5, torch.float32, (8, 2, 16, 4, 64))  # 256 KiB > limit
    other_request = make_block(7, torch.float32, (1, 2, 16, 4, 64), rid="req-2")
    last_good = make_block(6, torch.float16, (2, 2, 16, 4, 64))

    frames: list[kv_pb2.KVFrame] = [kv_pb2.KVFrame(payload=b"orphan")]  # no header yet
    frames += encode_frames(good, frame_bytes)[1]
    # Flip one byte of a payload frame "in transit"; header checksum is the true one.
    _, f = encode_frames(flipped, frame_bytes)
    data = bytearray(f[2].payload)
    data[17] ^= 0x40
    f[2] = kv_pb2.KVFrame(payload=bytes(data))
    frames += f
    # Deliberately wrong checksum in the header.
    _, f = encode_frames(bad_crc, frame_bytes)
    f[0].header.checksum ^= 1
    frames += f
    # Missing its last payload frame.
    frames += encode_frames(truncated, frame_bytes)[1][:-1]
    frames += encode_frames(refused, frame_bytes)[1]
    frames += encode_frames(too_big, frame_bytes)[1]
    frames += encode_frames(other_request, frame_bytes)[1]
    frames += encode_frames(last_good, frame_bytes)[1]

    async def body() -> None:
        sink = StoreSink(refuse={4})
        async with kv_server(sink, max_block_bytes=200 << 10) as (addr, servicer):
            async with grpc.aio.insecure_channel(addr, options=kv_grpc_options()) as channel:
                ack = await kv_pb2_grpc.KVTransferStub(channel).PushBlocks(iter(frames), timeout=30)
        assert sorted(ack.rejected_block_indices) == [1, 2, 3, 4, 5, 7]
        assert ack.blocks_received == 2
        assert set(sink.blocks) == {("req-1", 0), ("req-1", 6)}
        assert_arrived(sink, good)
        assert_arrived(sink, last_good)
        for reason in ("checksum mismatch", "exceeds limit", "without a header", "request_id"):
            assert reason in ack.error
        stats = servicer.stats
        assert (stats.blocks_rejected, stats.blocks_received, stats.failures) == (6, 2, 1)

    run(body)


def test_sender_reports_rejections() -> None:
    blocks = [make_block(i, torch.float32, (1, 2, 16, 2, 16)) for i in range(3)]

    async def body() -> None:
        sink = StoreSink(refuse={1})
        async with kv_server(sink) as (addr, _), GrpcKVSender() as sender:
            result = await sender.send_blocks(addr, blocks)
            assert not result.ok and result.rejected == [1] and result.blocks == 2
            assert "unexpected block_hash" in result.error
            assert sender.stats.blocks_rejected == 1
        assert set(sink.blocks) == {("req-1", 0), ("req-1", 2)}

    run(body)


def test_sender_errors() -> None:
    async def body() -> None:
        async with kv_server(StoreSink()) as (addr, _):
            pass  # server stopped: nothing listens on addr any more
        async with GrpcKVSender() as sender:
            with pytest.raises(ValueError, match="one request"):
                await sender.send_blocks(
                    addr, [make_block(0, torch.float32, (1, 4)), make_block(1, torch.float32, (1, 4), rid="other")]
                )
            with pytest.raises(KVTransportError, match="UNAVAILABLE"):
                await sender.send_blocks(addr, [make_block(0, torch.float32, (1, 4))], timeout=5)
            assert sender.stats.failures == 1

    run(body)
