"""The KV transports as byte pipes under the decode engine's KV connector: the same cases over
gRPC (a real in-process server on loopback), gRPC with the payloads in shared-memory segments,
the raw TCP data plane (a real listener on loopback), and the Ray object-store transport (its sender and receiver joined by a stand-in for the actor
call; the real Ray path runs in test_ray_serving)."""
from __future__ import annotations

import asyncio
import os
import time
import tracemalloc
from contextlib import asynccontextmanager
from typing import AsyncIterator

import grpc
import numpy as np
import pytest
import torch

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.engine.kv.handoff import HandoffState
from pdserve.v1 import kv_pb2
from pdserve.services.common.ports import free_port
from pdserve.services.kv_transfer import GrpcKVSender, KVBlock, KVSender, KVTransferError, KVTransferServicer
from pdserve.services.kv_transfer import frames, shared_memory
from pdserve.services.kv_transfer.frames import encode_open
from pdserve.services.kv_transfer.grpc_receiver import register_kv_servicer
from pdserve.services.kv_transfer.ray_transport import RayKVReceiver, RayKVSender
from pdserve.services.kv_transfer.tcp_receiver import KVDataListener
from pdserve.services.kv_transfer.tcp_transport import TcpKVSender
from pdserve.services.common.grpc_setup import options as channel_options
from pdserve.services.common.security import Credentials
from tests.conftest import assert_no_leak, random_prompts
from tests.services.kv_transfer.kv_servers import Resolved, kv_receiver, raw_push

TRANSPORTS = ("grpc", "grpc-shm", "tcp", "ray")
PROMPT = random_prompts(1, 60, 60, seed=77)[0]          # 8 blocks of 8 (the last one partial)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class _FakeActorMethod:
    """actor.method.remote(...) for the Ray transport: runs the receiver's method in this loop."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        result = self.fn(*args)
        return asyncio.ensure_future(result) if asyncio.iscoroutine(result) else _done(result)


def _done(value):
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


class _FakeActor:
    def __init__(self, receiver: RayKVReceiver) -> None:
        self.push_blocks = _FakeActorMethod(receiver.push_blocks)
        self.kv_heartbeat = _FakeActorMethod(receiver.heartbeat)
        self.kv_cancel = _FakeActorMethod(receiver.cancel)


def _segments() -> set[str]:
    """This process's segments (the senders here are in-process; other tests' deployments, running
    beside this one under pytest-xdist, write theirs to the same directory)."""
    mine = shared_memory.owner_prefix(os.getpid())
    return {n for n in os.listdir(shared_memory.SHM_DIR) if shared_memory.NAME.fullmatch(n) and n.startswith(mine)}


@pytest.fixture(autouse=True)
def no_segment_left():
    """Every shared-memory segment a test's sender wrote is gone when the test ends (the receiver
    unlinks what it maps; the sender removes what a failed or cancelled stream left)."""
    before = _segments()
    yield
    assert _segments() - before == set()


@asynccontextmanager
async def transport(kind: str, engine: LLMEngine, chunk_bytes: int) -> AsyncIterator[tuple[KVSender, str]]:
    """(sender, target) whose blocks land in engine's KV connector."""
    if kind.startswith("grpc"):
        shm = kind == "grpc-shm"
        async with kv_receiver(engine, shm=shm) as target:
            sender = GrpcKVSender(lambda a: grpc.aio.insecure_channel(a, options=channel_options()),
                                  frame_bytes=chunk_bytes, shared_memory=shm, shared_memory_min_bytes=0)
            try:
                yield sender, target
            finally:
                await sender.close()
    elif kind == "tcp":
        listener = KVDataListener(engine.kv, "127.0.0.1").start()
        sender = TcpKVSender(frame_bytes=chunk_bytes)
        try:
            yield sender, listener.address()
        finally:
            await sender.close()
            listener.close()
    else:
        actor = _FakeActor(RayKVReceiver(engine.kv))
        sender = RayKVSender(chunk_bytes=chunk_bytes, put=lambda arrays: Resolved(arrays))
        sender._actors["ray://decode"] = actor
        yield sender, "ray://decode"


def _blocks(rid: str, indices: list[int], engine: LLMEngine, seed: int = 0) -> list[KVBlock]:
    hashes = transfer_block_hashes(PROMPT, 8)
    g = torch.Generator().manual_seed(seed)
    return [KVBlock(rid, i, hashes[i], torch.randn(engine.runner.block_shape, generator=g)) for i in indices]


def _run(coro):
    return asyncio.run(coro)


def _sealed(token: bytes, bodies: list[bytes], segments: list[bytes] | None = None) -> list[bytes]:
    """Hand-made frames, each with its MAC (keyed without a cluster token, as these receivers are;
    over the body and then its shared-memory segment's bytes, if any) appended as the last field,
    as a sender seals them."""
    mac = frames.StreamMac(frames.mac_key(token, None))
    segments = segments or [b""] * len(bodies)
    return [body + kv_pb2.KVFrame(mac=mac.seal([body, seg])).SerializeToString()
            for body, seg in zip(bodies, segments)]


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("chunk_bytes", [4096, 4 << 20], ids=["blocks-span-frames", "blocks-share-frames"])
def test_blocks_land_bit_exact_and_the_request_becomes_ready(engine: LLMEngine, kind: str, chunk_bytes: int) -> None:
    rid = f"exact-{kind}-{chunk_bytes}"
    res = engine.reserve(rid, PROMPT, GREEDY)
    assert res.needed_block_indices == list(range(8))
    blocks = _blocks(rid, res.needed_block_indices, engine)

    async def run():
        async with transport(kind, engine, chunk_bytes) as (sender, target):
            stream = sender.open(target, rid, res.transfer_token)
            await stream.send(blocks[:5])          # the first chunk's blocks
            await stream.heartbeat()               # the next chunk computes
            await stream.send(blocks[5:])
            return await stream.finish(timeout=10)

    result = _run(run())
    assert (result.blocks, result.bytes) == (8, 8 * engine.runner.kv_bytes_per_block)
    assert engine.kv.state(rid) is HandoffState.READY
    table = engine.kv.receiving[rid].seq.block_table
    stored = engine.runner.read_blocks(table)
    for j, block in enumerate(blocks):
        assert torch.equal(stored[j], block.data)
    engine.abort(rid)
    assert_no_leak(engine)


def _refused(kind: str, engine: LLMEngine, rid: str, token: bytes, blocks: list[KVBlock]) -> KVTransferError:
    async def run():
        async with transport(kind, engine, 4 << 20) as (sender, target):
            stream = sender.open(target, rid, token)
            await stream.send(blocks)
            with pytest.raises(KVTransferError) as err:
                await stream.finish(timeout=10)
            return err.value
    return _run(run())


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("fault, code", [
    ("checksum", "DATA_LOSS"), ("hash", "DATA_LOSS"), ("layout", "DATA_LOSS"), ("index", "DATA_LOSS"),
])
def test_a_bad_block_fails_the_whole_request_and_frees_it(engine: LLMEngine, kind: str, fault: str, code: str,
                                                          monkeypatch) -> None:
    rid = f"bad-{kind}-{fault}"
    res = engine.reserve(rid, PROMPT, GREEDY)
    blocks = _blocks(rid, [0, 1, 2], engine)
    if fault == "checksum":
        original = KVBlock.encode

        def flipped(self, with_checksum: bool = False):
            header, payload = original(self, with_checksum=True)   # a CRC the bytes then miss
            corrupted = bytearray(payload)
            corrupted[5] ^= 0xFF
            return header, memoryview(corrupted)
        monkeypatch.setattr(KVBlock, "encode", flipped)
    elif fault == "hash":
        blocks[1].block_hash ^= 1
    elif fault == "layout":
        blocks[1].data = blocks[1].data[:, :, :4].contiguous()   # half a block
    elif fault == "index":
        blocks[1].block_index = 40
    err = _refused(kind, engine, rid, res.transfer_token, blocks)
    assert err.code == code, err
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert engine.kv.failure(rid).code == code
    assert_no_leak(engine)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_wrong_token_is_refused_and_leaves_the_reservation_alone(engine: LLMEngine, kind: str) -> None:
    rid = f"token-{kind}"
    res = engine.reserve(rid, PROMPT, GREEDY)
    err = _refused(kind, engine, rid, b"not-the-token-00", _blocks(rid, [0], engine))
    assert err.code == "UNAUTHENTICATED"
    assert engine.kv.state(rid) is HandoffState.RESERVED   # a stranger cannot fail it
    engine.abort(rid)
    err = _refused(kind, engine, "never-reserved", res.transfer_token, _blocks("never-reserved", [0], engine))
    assert err.code in ("NOT_FOUND", "ABORTED")
    assert_no_leak(engine)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_cancel_frees_the_reservation(engine: LLMEngine, kind: str) -> None:
    rid = f"cancel-{kind}"
    res = engine.reserve(rid, PROMPT, GREEDY)

    async def run():
        async with transport(kind, engine, 4 << 20) as (sender, target):
            stream = sender.open(target, rid, res.transfer_token)
            await stream.send(_blocks(rid, [0, 1], engine))
            for _ in range(500):   # the blocks arrived: the reservation is receiving when it is cancelled
                if engine.kv.state(rid) is HandoffState.RECEIVING:
                    break
                await asyncio.sleep(0.01)
            assert engine.kv.state(rid) is HandoffState.RECEIVING
            await stream.cancel()
            for _ in range(100):
                if engine.kv.state(rid) is not HandoffState.RECEIVING:
                    return
                await asyncio.sleep(0.02)
    _run(run())
    assert engine.kv.state(rid) is HandoffState.FAILED
    # gRPC sees a cancelled stream end early (DATA_LOSS); Ray gets an explicit cancel, and the TCP
    # data plane its connection closed mid-transfer (ABORTED)
    assert engine.kv.failure(rid).code == ("DATA_LOSS" if kind.startswith("grpc") else "ABORTED")
    assert_no_leak(engine)


def test_a_huge_declared_block_allocates_nothing(engine: LLMEngine) -> None:
    """A 60-byte header declaring a 256 MiB block is refused before any buffer exists."""
    rid = "huge"
    res = engine.reserve(rid, PROMPT, GREEDY)
    header = kv_pb2.KVBlockHeader(request_id=rid, block_index=0, block_hash=transfer_block_hashes(PROMPT, 8)[0],
                                  dtype="float32", shape=[64 << 20], nbytes=256 << 20, checksum=0)
    frames = _sealed(res.transfer_token, [kv_pb2.KVFrame(open=kv_pb2.KVStreamOpen(
        request_id=rid, transfer_token=res.transfer_token), headers=[header]).SerializeToString()])

    async def run():
        async with kv_receiver(engine, options=()) as target, grpc.aio.insecure_channel(target) as ch:
            call = raw_push(ch)
            tracemalloc.start()
            await call.write(frames[0])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            return err.value, peak
    err, peak = _run(run())
    assert err.code() == grpc.StatusCode.DATA_LOSS and "layout" in err.details()
    assert peak < 16 << 20, peak
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)


def test_ray_sender_sends_other_targets_through_its_fallback(engine: LLMEngine) -> None:
    async def run():
        async with transport("grpc", engine, 4 << 20) as (grpc_sender, target):
            sender = RayKVSender(fallback=grpc_sender, put=lambda a: Resolved(a))
            rid = "fallback"
            res = engine.reserve(rid, PROMPT, GREEDY)
            stream = sender.open(target, rid, res.transfer_token)
            await stream.send(_blocks(rid, list(range(8)), engine))
            return rid, await stream.finish(timeout=10)
    rid, result = _run(run())
    assert result.blocks == 8 and engine.kv.state(rid) is HandoffState.READY
    engine.abort(rid)
    assert_no_leak(engine)


def test_ray_receiver_refuses_objects_of_the_wrong_kind(engine: LLMEngine) -> None:
    rid = "kinds"
    res = engine.reserve(rid, PROMPT, GREEDY)
    block = _blocks(rid, [0], engine)[0]
    header, _ = block.encode()
    opened = kv_pb2.KVStreamOpen(request_id=rid, transfer_token=res.transfer_token).SerializeToString()
    receiver = RayKVReceiver(engine.kv)
    ack = kv_pb2.PushAck.FromString(_run(receiver.push_blocks(
        opened, [header.SerializeToString()], [Resolved([np.zeros(4, dtype=np.float32)])])))
    assert ack.error_code == "INVALID_ARGUMENT" and "uint8" in ack.error
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)


async def _push_raw(target: str, frames: list[bytes]) -> grpc.aio.AioRpcError | kv_pb2.PushAck:
    """Write hand-made frames on a KV stream; the error the receiver answers (or its ack)."""
    async with grpc.aio.insecure_channel(target) as ch:
        call = ch.stream_unary("/pdserve.v1.KVTransfer/PushBlocks", request_serializer=lambda b: b,
                               response_deserializer=kv_pb2.PushAck.FromString)()
        for frame in frames:
            await call.write(frame)
        await call.done_writing()
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            return exc


def _shm_frame(headers: list[kv_pb2.KVBlockHeader], name: str, size: int, payload: bytes = b"") -> bytes:
    return kv_pb2.KVFrame(headers=headers, payload=payload,
                          shm=kv_pb2.KVSharedMemory(name=name, size=size)).SerializeToString()


def _private_segment(data: bytes, mode: int = 0o600) -> str:
    name = shared_memory.write_segment([memoryview(data)])
    os.chmod(os.path.join(shared_memory.SHM_DIR, name), mode)
    return name


@pytest.mark.parametrize("case, code, says", [
    ("receiver-refuses-shm", "FAILED_PRECONDITION", "no KV through shared memory"),
    ("bad-name", "DATA_LOSS", "not a KV segment name"),
    ("missing", "FAILED_PRECONDITION", "No such file"),
    ("group-readable", "DATA_LOSS", "not a private file"),
    ("size-differs-from-headers", "INVALID_ARGUMENT", "segment of"),
    ("file-smaller-than-declared", "DATA_LOSS", "the headers declare"),
    ("inline-and-shm", "INVALID_ARGUMENT", "not both"),
])
def test_a_bad_shared_memory_frame_is_refused_and_frees_the_request(engine: LLMEngine, case: str, code: str,
                                                                     says: str) -> None:
    """A segment is mapped only when the receiver allows it, its name is of pdserve's form, it is a
    private regular file of this user, and its size is exactly what the checked headers declare;
    a refusal fails the request (its blocks freed) and unlinks nothing but what it was sent."""
    rid = f"shm-{case}"
    res = engine.reserve(rid, PROMPT, GREEDY)
    header, payload = _blocks(rid, [0], engine)[0].encode()
    data = bytes(payload)
    made: list[str] = []
    name, size, inline = "", len(data), b""
    if case == "bad-name":
        name = "../../etc/passwd"
    elif case == "missing":
        name = "pdserve-kv-1-" + "0" * 32
    elif case == "file-smaller-than-declared":
        name = _private_segment(data[:-4])
    else:
        name = _private_segment(data, 0o640 if case == "group-readable" else 0o600)
    if case == "size-differs-from-headers":
        size = len(data) + 4096
    if case == "inline-and-shm":
        inline = data
    if name.startswith("pdserve-kv-"):
        made.append(name)
    frames = _sealed(res.transfer_token, [encode_open(rid, res.transfer_token),
                                          _shm_frame([header], name, size, inline)])

    async def run():
        async with kv_receiver(engine, shm=case != "receiver-refuses-shm") as target:
            return await _push_raw(target, frames)
    try:
        err = _run(run())
        assert isinstance(err, grpc.aio.AioRpcError), err
        assert err.code().name == code and says in err.details(), (err.code(), err.details())
        assert engine.kv.state(rid) is HandoffState.FAILED
        assert_no_leak(engine)
    finally:
        for n in made:
            shared_memory.remove(n)


def test_a_shared_memory_segment_is_unlinked_once_mapped(engine: LLMEngine) -> None:
    rid = "shm-unlinked"
    res = engine.reserve(rid, PROMPT, GREEDY)
    blocks = _blocks(rid, list(range(8)), engine, seed=3)
    encoded = [b.encode() for b in blocks]
    data = b"".join(bytes(p) for _, p in encoded)
    name = _private_segment(data)
    frames = _sealed(res.transfer_token, [encode_open(rid, res.transfer_token),
                                          _shm_frame([h for h, _ in encoded], name, len(data))], [b"", data])

    async def run():
        async with kv_receiver(engine, shm=True) as target:
            return await _push_raw(target, frames)
    ack = _run(run())
    assert isinstance(ack, kv_pb2.PushAck) and ack.blocks_received == 8, ack
    assert not os.path.exists(os.path.join(shared_memory.SHM_DIR, name))
    stored = engine.runner.read_blocks(engine.kv.receiving[rid].seq.block_table)
    assert all(torch.equal(stored[j], b.data) for j, b in enumerate(blocks))
    engine.abort(rid)
    assert_no_leak(engine)


def test_shared_memory_is_only_for_loopback_targets() -> None:
    assert shared_memory.is_local("127.0.0.1:5000") and shared_memory.is_local("[::1]:5000")
    assert shared_memory.is_local("localhost:5000")
    assert not shared_memory.is_local("10.0.0.7:5000") and not shared_memory.is_local("decode-0:5000")


def test_a_sweep_removes_only_old_segments_of_this_user() -> None:
    old, new = _private_segment(b"x" * 64), _private_segment(b"y" * 64)
    try:
        past = os.path.getmtime(os.path.join(shared_memory.SHM_DIR, old)) - 3600
        os.utime(os.path.join(shared_memory.SHM_DIR, old), (past, past))
        assert shared_memory.sweep(600) >= 1
        assert not os.path.exists(os.path.join(shared_memory.SHM_DIR, old))
        assert os.path.exists(os.path.join(shared_memory.SHM_DIR, new))
    finally:
        shared_memory.remove(old)
        shared_memory.remove(new)


def test_small_sends_stay_in_the_stream_and_large_ones_use_shared_memory(engine: LLMEngine, monkeypatch) -> None:
    """One stream mixes both: sends under the threshold inline, the rest through segments."""
    rid = "shm-mixed"
    res = engine.reserve(rid, PROMPT, GREEDY)
    blocks = _blocks(rid, res.needed_block_indices, engine, seed=5)
    written: list[str] = []
    write = shared_memory.write_segment
    monkeypatch.setattr(shared_memory, "write_segment",
                        lambda payloads, *d: written.append(write(payloads, *d)) or written[-1])

    async def run():
        async with kv_receiver(engine, shm=True) as target:
            sender = GrpcKVSender(lambda a: grpc.aio.insecure_channel(a, options=channel_options()), shared_memory=True,
                                  shared_memory_min_bytes=3 * engine.runner.kv_bytes_per_block)
            try:
                stream = sender.open(target, rid, res.transfer_token)
                await stream.send(blocks[:2])      # under the threshold: in the stream
                assert written == []
                await stream.send(blocks[2:])      # six blocks: the peer's probe, then one segment
                assert len(written) == 2
                return await stream.finish(timeout=10)
            finally:
                await sender.close()
    assert _run(run()).blocks == 8
    stored = engine.runner.read_blocks(engine.kv.receiving[rid].seq.block_table)
    assert all(torch.equal(stored[j], b.data) for j, b in enumerate(blocks))
    engine.abort(rid)
    assert_no_leak(engine)


def test_a_stream_proves_membership_with_a_proof_made_once_connected(engine: LLMEngine) -> None:
    """A stream opened before its receiver answers (this process frozen while it connected, a
    decode worker restarting) sends a proof of membership made once its channel connected: one
    made at open is stale after a long wait, and the receiver refuses it (UNAUTHENTICATED)."""
    creds = Credentials("a-cluster-token-for-this-test-only")
    minted: list[float] = []

    def proof(method: str, target: str, first: bytes):
        minted.append(time.monotonic())
        return creds.call_proof(method, target, first)

    port = free_port()
    rid = "proof-when-connected"

    async def run() -> tuple[float, object, int]:
        sender = GrpcKVSender(lambda a: grpc.aio.insecure_channel(a, options=channel_options()), proof=proof,
                              cluster_token=creds.cluster_token)
        res = engine.reserve(rid, PROMPT, GREEDY)
        stream = sender.open(f"127.0.0.1:{port}", rid, res.transfer_token)   # nothing listens there yet
        await stream.send(_blocks(rid, res.needed_block_indices, engine))
        await asyncio.sleep(0.5)   # kept: the receiver comes up late (what is tested), the sender trying meanwhile
        interceptors = creds.server_interceptors()
        interceptors[0].serve_at("127.0.0.1", port)   # the names its proofs must give (start_server does this)
        server = grpc.aio.server(interceptors=interceptors)
        register_kv_servicer(KVTransferServicer(engine.kv, cluster_token=creds.cluster_token), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        listening = time.monotonic()
        await server.start()
        try:
            return listening, await stream.finish(timeout=30), len(res.needed_block_indices)
        finally:
            await sender.close()
            await server.stop(None)

    listening, result, needed = _run(run())
    assert result.blocks == needed > 0
    assert minted and min(minted) >= listening, (minted, listening)   # made after the receiver came up
    assert engine.kv.state(rid) is HandoffState.READY
    engine.abort(rid)
    assert_no_leak(engine)
