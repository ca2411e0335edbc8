"""The object-store KV transport's wire logic, without a cluster: the receiver gets awaitables
standing in for object references, the sender's put and actor call are stood in for too.
(The real thing, through a Ray cluster, is in test_ray_serving.py.)"""
from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
import torch

from pdserve.v1 import kv_pb2
from services.kv_transfer import BlockHeader, KVBlock, KVIntegrityError, encode_block
from services.kv_transfer.grpc_transport import header_to_proto
from services.kv_transfer.ray_transport import (
    RayKVReceiver,
    RayKVSender,
    _chunks,
    parse_ray_target,
    ray_kv_address,
)

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
SHAPE = (2, 2, 4, 2, 8)


class PoolSink:
    """Like the decode worker: checks the hash it expects, keeps a copy of the block."""

    def __init__(self, hashes: dict[int, int] | None = None) -> None:
        self.hashes = hashes
        self.blocks: dict[int, torch.Tensor] = {}

    async def accept_block(self, header: BlockHeader, payload) -> None:
        if self.hashes is not None and self.hashes.get(header.block_index) != header.block_hash:
            raise KVIntegrityError(f"block {header.block_index}: chain hash mismatch")
        from services.kv_transfer import decode_tensor
        self.blocks[header.block_index] = decode_tensor(header, payload).clone()


def make_blocks(n: int, rid: str = "r1", dtype=torch.float32) -> list[KVBlock]:
    gen = torch.Generator().manual_seed(n)
    return [KVBlock.from_tensor(torch.randn(SHAPE, generator=gen).to(dtype), request_id=rid, block_index=i,
                                block_hash=1000 + i, num_tokens=4, layer_start=0, layer_end=SHAPE[0])
            for i in range(n)]


def _value(v) -> asyncio.Future:
    """An already-resolved awaitable, standing in for an object reference (call inside the loop)."""
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(v)
    return fut


def wire(blocks: list[KVBlock]) -> tuple[list[bytes], list[np.ndarray]]:
    headers, arrays = [], []
    for b in blocks:
        h, payload = encode_block(b)
        headers.append(header_to_proto(h, 1).SerializeToString())
        arrays.append(np.frombuffer(payload, dtype=np.uint8).copy())
    return headers, arrays


def push(receiver: RayKVReceiver, headers, objects) -> kv_pb2.PushAck:
    async def run():
        refs = [_value(o) for o in objects]
        return kv_pb2.PushAck.FromString(await receiver.push_blocks(headers, refs))
    return asyncio.run(run())


def test_addresses() -> None:
    assert ray_kv_address("pd-decode-0", "pdserve") == "ray://pdserve/pd-decode-0"
    assert parse_ray_target("ray://pdserve/pd-decode-0") == ("pdserve", "pd-decode-0")
    assert parse_ray_target("ray://pd-decode-0") == (None, "pd-decode-0")
    with pytest.raises(ValueError):
        parse_ray_target("127.0.0.1:5000")


def test_chunks_group_consecutive_blocks() -> None:
    blocks = make_blocks(5)
    nbytes = encode_block(blocks[0])[0].nbytes
    groups = _chunks(blocks, 2 * nbytes)
    assert [[b.block_index for b in g] for g in groups] == [[0, 1], [2, 3], [4]]
    assert len(_chunks(blocks, 1)) == 5            # a block larger than the chunk still goes alone
    assert len(_chunks(blocks, 1 << 30)) == 1


def test_blocks_arrive_bit_exact_in_one_or_several_objects() -> None:
    blocks = make_blocks(4, dtype=torch.bfloat16)
    headers, arrays = wire(blocks)
    for objects in ([arrays], [arrays[:1], arrays[1:3], arrays[3:]]):
        sink = PoolSink()
        ack = push(RayKVReceiver(sink), headers, objects)
        assert (ack.blocks_received, list(ack.rejected_block_indices)) == (4, [])
        assert ack.bytes_received == sum(a.nbytes for a in arrays)
        for b in blocks:
            assert torch.equal(sink.blocks[b.block_index], b.data)


def test_corrupted_payload_is_refused_and_never_reaches_the_sink() -> None:
    blocks = make_blocks(3)
    headers, arrays = wire(blocks)
    arrays[1][5] ^= 0xFF
    sink = PoolSink()
    rx = RayKVReceiver(sink)
    ack = push(rx, headers, [arrays])
    assert list(ack.rejected_block_indices) == [1] and ack.blocks_received == 2
    assert "checksum mismatch" in ack.error and 1 not in sink.blocks
    assert rx.stats.blocks_rejected == 1


def test_sink_refusal_fails_closed() -> None:
    blocks = make_blocks(2)
    headers, arrays = wire(blocks)
    sink = PoolSink(hashes={0: 1000, 1: 4242})   # block 1's chain hash is not the reserved one
    ack = push(RayKVReceiver(sink), headers, [arrays])
    assert list(ack.rejected_block_indices) == [1] and "chain hash mismatch" in ack.error


@pytest.mark.parametrize("objects, message", [
    ([np.zeros(8, dtype=np.uint8)], "expected a list"),                 # not a list
    ([[np.zeros((2, 4), dtype=np.uint8)]], "flat uint8 array"),         # not flat
    ([[np.zeros(8, dtype=np.float32)]], "flat uint8 array"),            # not uint8
    ([[b"raw bytes"]], "flat uint8 array"),                             # not an array
])
def test_objects_of_the_wrong_kind_are_refused(objects, message) -> None:
    headers, _ = wire(make_blocks(1))
    ack = push(RayKVReceiver(PoolSink()), headers, objects)
    assert list(ack.rejected_block_indices) == [0] and message in ack.error


def test_header_payload_count_mismatch_is_a_protocol_error() -> None:
    headers, arrays = wire(make_blocks(2))
    rx = RayKVReceiver(PoolSink())
    ack = push(rx, headers, [arrays[:1]])
    assert ack.blocks_received == 0 and "2 headers for 1 payloads" in ack.error
    assert rx.stats.failures == 1


def test_a_bad_header_refuses_the_whole_call() -> None:
    headers, arrays = wire(make_blocks(2))
    sink = PoolSink()
    ack = push(RayKVReceiver(sink), [headers[0], b"\xff\xff\xff"], [arrays])
    assert ack.blocks_received == 0 and "bad header" in ack.error and not sink.blocks


def test_blocks_of_another_request_in_the_call_are_refused() -> None:
    a, b = make_blocks(1, rid="a"), make_blocks(2, rid="b")[1:]
    headers, arrays = wire(a + b)
    ack = push(RayKVReceiver(PoolSink()), headers, [arrays])
    assert list(ack.rejected_block_indices) == [1] and "request_id" in ack.error


def test_oversized_block_is_refused_by_the_header_check() -> None:
    headers, arrays = wire(make_blocks(1))
    ack = push(RayKVReceiver(PoolSink(), max_block_bytes=16), headers, [arrays])
    assert list(ack.rejected_block_indices) == [0] and "exceeds limit" in ack.error


# ---- sender, with put and the actor call stood in for ---------------------------------------
class FakeRemote:
    def __init__(self, receiver: RayKVReceiver, calls: list) -> None:
        self.receiver, self.calls = receiver, calls

    def remote(self, headers, refs):
        self.calls.append(len(headers))
        return self.receiver.push_blocks(headers, [_value(r) for r in refs])


class FakeActor:
    def __init__(self, receiver: RayKVReceiver) -> None:
        self.calls: list[int] = []
        self.push_blocks = FakeRemote(receiver, self.calls)


def _sender(receiver: RayKVReceiver, chunk_bytes: int) -> tuple[RayKVSender, FakeActor]:
    sender = RayKVSender(chunk_bytes=chunk_bytes)
    actor = FakeActor(receiver)
    sender._actors["ray://ns/decode"] = actor

    async def put(payloads):   # what ray.put stores: one list of flat uint8 arrays
        return [np.frombuffer(p, dtype=np.uint8).copy() for p in payloads]
    sender._put = put
    return sender, actor


@needs_ray
def test_sender_chunks_and_merges_acks() -> None:
    blocks = make_blocks(5)
    nbytes = encode_block(blocks[0])[0].nbytes
    sink = PoolSink()
    sender, actor = _sender(RayKVReceiver(sink), chunk_bytes=2 * nbytes)
    result = asyncio.run(sender.send_blocks("ray://ns/decode", blocks))
    assert actor.calls == [2, 2, 1]
    assert result.ok and result.blocks == 5 and result.bytes == 5 * nbytes
    assert sender.stats.blocks_sent == 5 and sender.stats.bytes_sent == 5 * nbytes
    assert all(torch.equal(sink.blocks[b.block_index], b.data) for b in blocks)


@needs_ray
def test_sender_reports_rejections_across_chunks() -> None:
    blocks = make_blocks(4)
    nbytes = encode_block(blocks[0])[0].nbytes
    sink = PoolSink(hashes={0: 1000, 1: 1001, 2: 9, 3: 1003})
    sender, _ = _sender(RayKVReceiver(sink), chunk_bytes=2 * nbytes)
    result = asyncio.run(sender.send_blocks("ray://ns/decode", blocks))
    assert result.rejected == [2] and result.blocks == 3 and "chain hash mismatch" in result.error


@needs_ray
def test_sender_fails_closed_on_an_ack_that_does_not_add_up() -> None:
    class Lossy(RayKVReceiver):
        async def push_blocks(self, headers, refs):
            return kv_pb2.PushAck(blocks_received=len(headers) - 1).SerializeToString()

    blocks = make_blocks(3)
    sender, _ = _sender(Lossy(PoolSink()), chunk_bytes=1 << 30)
    result = asyncio.run(sender.send_blocks("ray://ns/decode", blocks))
    assert result.rejected == [0, 1, 2] and "accounted for 2 of 3" in result.error


@needs_ray
def test_non_ray_targets_go_through_the_fallback() -> None:
    class Recorder(RayKVSender):
        def __init__(self):
            super().__init__()
            self.targets = []

        async def send_blocks(self, target, blocks, *, timeout=None):
            self.targets.append(target)
            from services.kv_transfer import SendResult
            return SendResult(blocks=len(blocks), bytes=0, seconds=0.0)

    fallback = Recorder()
    sender = RayKVSender(fallback=fallback)
    asyncio.run(sender.send_blocks("127.0.0.1:1234", make_blocks(1)))
    assert fallback.targets == ["127.0.0.1:1234"]
    from services.kv_transfer import KVTransportError
    with pytest.raises(KVTransportError):
        asyncio.run(RayKVSender().send_blocks("127.0.0.1:1234", make_blocks(1)))
