"""The KV hand-off's MAC against an on-path attacker without TLS: a real gRPC relay between a real
sender and a real receiver (feeding a real decode engine's connector) rewrites frames the way an
attacker who reads the wire can: it flips a payload byte or swaps two blocks' headers, fixes the
header CRC-32, and reseals the frame with the only key it can compute (the transfer token's, read
off the open frame). With the cluster token on both ends, every such rewrite fails closed with
DATA_LOSS, the reservation's blocks are freed and none enters the prefix cache."""
from __future__ import annotations

import asyncio
import os
import zlib
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import grpc
import pytest
import torch

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.engine.kv.handoff import HandoffState
from pdserve.v1 import kv_pb2
from pdserve.services.common.grpc_setup import options as channel_options
from pdserve.services.kv_transfer import GrpcKVSender, KVBlock, KVTransferError, frames, shared_memory
from pdserve.services.kv_transfer.grpc_transport import METHOD
from pdserve.services.kv_transfer.grpc_receiver import SERVICE
from pdserve.services.kv_transfer.frames import parse_frame
from pdserve.services.kv_transfer.ray_transport import RayKVReceiver, RayKVSender
from tests.conftest import assert_no_leak, random_prompts
from tests.services.kv_transfer.kv_servers import Resolved, kv_receiver, on_loopback, refusal_of

PROMPT = random_prompts(1, 60, 60, seed=91)[0]          # 8 blocks of 8 (the last one partial)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CLUSTER = "cluster-token-of-this-deployment"


def _blocks(rid: str, engine: LLMEngine) -> list[KVBlock]:
    hashes = transfer_block_hashes(PROMPT, 8)
    g = torch.Generator().manual_seed(5)
    return [KVBlock(rid, i, hashes[i], torch.randn(engine.runner.block_shape, generator=g)) for i in range(8)]


class Attacker:
    """Rewrites the frames of one stream as an on-path host can: it knows the wire format, the
    unkeyed CRC-32 and the transfer token (it travels in clear), not the cluster token."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.mac: frames.StreamMac | None = None
        self.rewritten = 0
        self.algorithm = ""         # the MAC algorithm the stream's open frame names
        self.segments_seen = 0      # frames of the stream whose payload was in shared memory

    def __call__(self, raw: bytes) -> bytes:
        frame = parse_frame(raw)
        if frame.open is not None and frame.open.request_id:
            self.mac = frames.StreamMac(frames.mac_key(frame.open.transfer_token, None),
                                           frame.open.mac_algorithm)
            self.algorithm = frame.open.mac_algorithm or frames.HMAC_SHA256
        if self.how == "none" or self.mac is None or (frame.open is not None and not frame.open.request_id):
            return raw                                 # nothing to rewrite, or a shared-memory probe
        body = bytes(frame.signed)
        headers, payload = list(frame.headers), bytearray(frame.payload)
        if not self.rewritten and frame.shm is not None and self.how == "payload":
            self._flip_segment(frame.shm.name, headers)
            body = kv_pb2.KVFrame(headers=headers, shm=frame.shm).SerializeToString()
        elif not self.rewritten and len(headers) >= 2 and payload:
            a, b = headers[0].nbytes, headers[1].nbytes
            if self.how == "payload":
                payload[5] ^= 0x01
            else:                                      # "swap": blocks 0 and 1 trade identities
                headers[0], headers[1] = headers[1], headers[0]
                payload[:a + b] = payload[a:a + b] + payload[:a]
            offset = 0
            for h in headers:                          # CRCs that match the rewritten bytes
                h.checksum = zlib.crc32(payload[offset:offset + h.nbytes]) & 0xFFFFFFFF
                offset += h.nbytes
            self.rewritten += 1
            body = kv_pb2.KVFrame(headers=headers, payload=bytes(payload)).SerializeToString()
        self.segments_seen += frame.shm is not None
        covered = [self._segment(frame.shm)] if frame.shm is not None else []
        return body + kv_pb2.KVFrame(mac=self.mac.seal([body, *covered])).SerializeToString()

    def _flip_segment(self, name: str, headers: list[kv_pb2.KVBlockHeader]) -> None:
        path = os.path.join(shared_memory.SHM_DIR, name)
        with open(path, "r+b") as f:
            data = bytearray(f.read())
            data[5] ^= 0x01
            f.seek(0)
            f.write(data)
        headers[0].checksum = zlib.crc32(data[:headers[0].nbytes]) & 0xFFFFFFFF
        self.rewritten += 1

    @staticmethod
    def _segment(shm: kv_pb2.KVSharedMemory) -> bytes:
        with open(os.path.join(shared_memory.SHM_DIR, shm.name), "rb") as f:
            return f.read()


receiver = kv_receiver   # the name the modules importing it from here use


@asynccontextmanager
async def relay(target: str, rewrite: Callable[[bytes], bytes]) -> AsyncIterator[str]:
    """A gRPC-level proxy for PushBlocks (raw bytes in and out) that rewrites every frame."""
    channel = grpc.aio.insecure_channel(target, options=channel_options())
    forward = channel.stream_unary(METHOD, request_serializer=lambda b: b,
                                   response_deserializer=kv_pb2.PushAck.FromString)

    async def push(request_iterator, context):
        call = forward()
        async for raw in request_iterator:
            await call.write(rewrite(raw))
        await call.done_writing()
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details())

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *channel_options()])
    handler = grpc.stream_unary_rpc_method_handler(push, response_serializer=kv_pb2.PushAck.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"PushBlocks": handler}),))
    try:
        async with on_loopback(server) as address:
            yield address
    finally:
        await channel.close()


async def _push(engine: LLMEngine, rid: str, how: "str | Attacker", sender_token: str | None, receiver_token: str | None,
                shm: bool = False) -> KVTransferError | None:
    res = engine.reserve(rid, PROMPT, GREEDY)
    async with receiver(engine, receiver_token, shm) as target, relay(target, Attacker(how) if isinstance(how, str) else how) as proxy:
        sender = GrpcKVSender(lambda a: grpc.aio.insecure_channel(a, options=channel_options()),
                              cluster_token=sender_token, shared_memory=shm, shared_memory_min_bytes=0)
        try:
            stream = sender.open(proxy, rid, res.transfer_token)
            await stream.send(_blocks(rid, engine))
            try:
                await stream.finish(timeout=30)
            except KVTransferError as exc:
                return exc
            return None
        finally:
            await sender.close()


def _nothing_cached(engine: LLMEngine, rid: str) -> None:
    """A fresh reservation of the same prompt finds no block of the refused transfer cached."""
    again = engine.reserve(rid + "-again", PROMPT, GREEDY)
    assert again.held_block_hashes == [] and again.needed_block_indices == list(range(8)), again
    engine.abort(rid + "-again")


def test_an_untouched_relayed_transfer_is_accepted(engine: LLMEngine) -> None:
    rid = "relayed-good"
    assert asyncio.run(_push(engine, rid, "none", CLUSTER, CLUSTER)) is None
    assert engine.kv.state(rid) is HandoffState.READY
    stored = engine.runner.read_blocks(engine.kv.receiving[rid].seq.block_table)
    assert all(torch.equal(stored[j], b.data) for j, b in enumerate(_blocks(rid, engine)))
    engine.abort(rid)
    assert_no_leak(engine)


@pytest.mark.parametrize("how, shm", [("payload", False), ("swap", False), ("payload", True)],
                         ids=["flipped-payload-byte", "swapped-headers", "flipped-shared-memory-byte"])
def test_a_block_rewritten_on_the_path_fails_closed(engine: LLMEngine, how: str, shm: bool) -> None:
    if shm and not shared_memory.available():
        pytest.skip(f"no usable shared memory at {shared_memory.SHM_DIR}")
    rid = f"rewritten-{how}-{shm}"
    attacker = Attacker(how)
    err = asyncio.run(_push(engine, rid, attacker, CLUSTER, CLUSTER, shm=shm))
    assert attacker.rewritten == 1 and attacker.segments_seen == (1 if shm else 0)
    assert err is not None and err.code == "DATA_LOSS" and "MAC" in str(err), err
    assert engine.kv.state(rid) is HandoffState.FAILED and engine.kv.failure(rid).code == "DATA_LOSS"
    assert_no_leak(engine)
    _nothing_cached(engine, rid)
    assert_no_leak(engine)


def test_a_sender_of_another_deployment_fails_closed(engine: LLMEngine) -> None:
    rid = "other-cluster"
    err = asyncio.run(_push(engine, rid, "none", "another-deployment's-token", CLUSTER))
    assert err is not None and err.code == "DATA_LOSS", err
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)
    _nothing_cached(engine, rid)


def test_a_stream_under_an_unknown_mac_algorithm_is_refused(engine: LLMEngine) -> None:
    rid = "unknown-algorithm"
    res = engine.reserve(rid, PROMPT, GREEDY)
    opened = kv_pb2.KVFrame(open=kv_pb2.KVStreamOpen(request_id=rid, transfer_token=res.transfer_token,
                                                     mac_algorithm="crc32")).SerializeToString()

    async def run():
        async with receiver(engine, CLUSTER) as target:
            return await refusal_of(target, [opened])
    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "crc32" in err.details(), err
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)


@pytest.mark.parametrize("algorithm", frames.ALGORITHMS)
def test_every_available_mac_algorithm_carries_a_transfer(engine: LLMEngine, algorithm: str, monkeypatch) -> None:
    monkeypatch.setattr(frames, "PREFERRED", algorithm)
    rid = f"algorithm-{algorithm}"
    attacker = Attacker("none")
    assert asyncio.run(_push(engine, rid, attacker, CLUSTER, CLUSTER)) is None
    assert attacker.algorithm == algorithm and engine.kv.state(rid) is HandoffState.READY
    engine.abort(rid)
    assert_no_leak(engine)


def test_without_a_cluster_token_the_transfer_token_keys_the_mac(engine: LLMEngine) -> None:
    """--insecure-no-auth: frames are still MACed (accidents are caught), keyed by the transfer token."""
    rid = "no-cluster-token"
    assert asyncio.run(_push(engine, rid, "none", None, None)) is None
    assert engine.kv.state(rid) is HandoffState.READY
    engine.abort(rid)
    assert_no_leak(engine)


def test_a_ray_object_rewritten_in_the_store_fails_closed(engine: LLMEngine) -> None:
    """The Ray call's MAC covers what the receiver fetched: a byte flipped in the stored array (its
    header CRC fixed) is refused."""
    rid = "ray-rewritten"
    res = engine.reserve(rid, PROMPT, GREEDY)
    receiving = RayKVReceiver(engine.kv, cluster_token=CLUSTER)

    def put(arrays):
        arrays[0][5] ^= 1            # the object store's copy, rewritten after the sender's MAC
        return Resolved(arrays)

    class Actor:
        class push_blocks:            # noqa: N801 - actor.method.remote(...), as Ray spells it
            @staticmethod
            def remote(opened, headers, refs):
                header = kv_pb2.KVBlockHeader.FromString(headers[0])
                header.checksum = zlib.crc32(refs[0].value[0]) & 0xFFFFFFFF
                return asyncio.ensure_future(receiving.push_blocks(opened, [header.SerializeToString(), *headers[1:]],
                                                                   refs))

    async def run():
        sender = RayKVSender(put=put, cluster_token=CLUSTER)
        sender._actors["ray://decode"] = Actor()
        stream = sender.open("ray://decode", rid, res.transfer_token)
        await stream.send(_blocks(rid, engine))
        with pytest.raises(KVTransferError) as err:
            await stream.finish(timeout=30)
        return err.value
    err = asyncio.run(run())
    assert err.code == "DATA_LOSS" and "MAC" in str(err), err
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)
    _nothing_cached(engine, rid)
