"""KV wire compression through the real gRPC transport: a real sender, a real receiver feeding a
real decode engine's connector (and, for rewrites, the on-path relay of test_kv_integrity).
Each codec lands the blocks exactly (lossless) or within int8's bound; a rewritten compressed
frame fails its MAC; a codec error or an oversized declared size is refused before allocation,
and nothing of a refused transfer enters the prefix cache; ``auto`` goes off first, then lossless
once the target's link estimator knows a rate below the break-even."""
from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from pdserve.engine import LLMEngine
from pdserve.engine.kv.handoff import HandoffState
from pdserve.v1 import kv_pb2
from pdserve.services.common.grpc_setup import options as channel_options
from pdserve.services.kv_transfer import GrpcKVSender, KVBlock, KVTransferError, wire_codec, frames
from pdserve.services.kv_transfer.frames import _HEADER, _PAYLOAD, _field, _sealed, encode_open
from pdserve.services.kv_transfer.frames import parse_frame
from pdserve.services.kv_transfer.ray_transport import RayKVReceiver, RayKVSender
from pdserve.services.workers.worker_metrics import WorkerMetrics
from pdserve.services.workers.config import KV_COMPRESSION_MODES, WorkerConfig
from tests.conftest import assert_no_leak
from tests.services.kv_transfer.kv_servers import Resolved, refusal_of
from tests.services.kv_transfer.test_kv_integrity import (CLUSTER, GREEDY, PROMPT, Attacker, _blocks,
                                                          _nothing_cached, receiver, relay)


class Recorder(Attacker):
    """Passes frames through untouched, keeping the block headers it saw."""

    def __init__(self) -> None:
        super().__init__("none")
        self.headers: list[kv_pb2.KVBlockHeader] = []

    def __call__(self, raw: bytes) -> bytes:
        self.headers += parse_frame(raw).headers
        return raw


def _sender(mode: str, cluster_token: str | None = CLUSTER) -> GrpcKVSender:
    return GrpcKVSender(lambda a: grpc.aio.insecure_channel(a, options=channel_options()),
                        cluster_token=cluster_token, kv_compression=mode)


async def _push(engine: LLMEngine, sender: GrpcKVSender, rid: str, rewrite, cluster_token: str | None = CLUSTER):
    """One transfer of PROMPT's blocks through a relay; (SendResult or KVTransferError, relay address)."""
    res = engine.reserve(rid, PROMPT, GREEDY)
    async with receiver(engine, cluster_token) as target, relay(target, rewrite) as proxy:
        stream = sender.open(proxy, rid, res.transfer_token)
        await stream.send(_blocks(rid, engine))
        try:
            return await stream.finish(timeout=30), proxy
        except KVTransferError as exc:
            return exc, proxy


def _stored(engine: LLMEngine, rid: str) -> list[torch.Tensor]:
    return list(engine.runner.read_blocks(engine.kv.receiving[rid].seq.block_table))


@pytest.mark.parametrize("codec", ["off", "lossless", "int8"])
def test_each_codec_lands_the_blocks(engine: LLMEngine, codec: str) -> None:
    rid, seen = f"codec-{codec}", Recorder()

    async def run():
        sender = _sender(codec)
        try:
            return (await _push(engine, sender, rid, seen))[0]
        finally:
            await sender.close()
    result = asyncio.run(run())
    assert not isinstance(result, KVTransferError), result
    assert engine.kv.state(rid) is HandoffState.READY
    raw = 8 * engine.runner.kv_bytes_per_block
    assert (result.blocks, result.bytes, result.codec) == (8, raw, codec)
    assert len(seen.headers) == 8 and {h.codec for h in seen.headers} == ({""} if codec == "off" else {codec})
    assert result.wire_bytes == sum(h.nbytes for h in seen.headers)
    if codec == "off":
        assert result.wire_bytes == raw
    else:
        assert all(h.raw_nbytes == engine.runner.kv_bytes_per_block for h in seen.headers)
        assert result.wire_bytes < raw * (0.9 if codec == "lossless" else 0.6), (result.wire_bytes, raw)
    for got, sent in zip(_stored(engine, rid), (b.data for b in _blocks(rid, engine))):
        if codec == "int8":   # within half a step of each (layer, k/v, token, head) vector's scale
            x = sent.reshape(-1, sent.shape[-1])
            bound = x.abs().amax(dim=1, keepdim=True) / 127 * 0.5 + 1e-6
            assert bool(((got.reshape(x.shape) - x).abs() <= bound).all())
            assert not torch.equal(got, sent)
        else:
            assert torch.equal(got, sent)
    engine.abort(rid)
    assert_no_leak(engine)


def test_a_rewritten_compressed_frame_fails_its_mac(engine: LLMEngine) -> None:
    rid, attacker = "codec-rewritten", Attacker("payload")

    async def run():
        sender = _sender("lossless")
        try:
            return (await _push(engine, sender, rid, attacker))[0]
        finally:
            await sender.close()
    err = asyncio.run(run())
    assert attacker.rewritten == 1
    assert isinstance(err, KVTransferError) and err.code == "DATA_LOSS" and "MAC" in str(err), err
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)
    _nothing_cached(engine, rid)
    assert_no_leak(engine)


class CorruptCodec(Attacker):
    """Without a cluster token the MAC key is the transfer token's, so a relay can reseal: it breaks
    the first compressed block's codec header (its magic) and the MAC still passes."""

    def __call__(self, raw: bytes) -> bytes:
        frame = parse_frame(raw)
        if frame.open is not None and frame.open.request_id:
            self.mac = frames.StreamMac(frames.mac_key(frame.open.transfer_token, None), frame.open.mac_algorithm)
        body = bytes(frame.signed)
        if not self.rewritten and frame.headers and frame.payload.nbytes:
            payload = bytearray(frame.payload)
            payload[0] ^= 0xFF
            body = kv_pb2.KVFrame(headers=frame.headers, payload=bytes(payload)).SerializeToString()
            self.rewritten += 1
        return body + kv_pb2.KVFrame(mac=self.mac.seal([body])).SerializeToString()


def test_a_codec_error_under_a_good_mac_fails_closed(engine: LLMEngine) -> None:
    rid, corrupt = "codec-corrupt", CorruptCodec("payload")

    async def run():
        sender = _sender("lossless", cluster_token=None)
        try:
            return (await _push(engine, sender, rid, corrupt, cluster_token=None))[0]
        finally:
            await sender.close()
    err = asyncio.run(run())
    assert corrupt.rewritten == 1
    assert isinstance(err, KVTransferError) and err.code == "DATA_LOSS", err
    assert "header.codec 'lossless'" in str(err) and "magic" in str(err), err
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)
    _nothing_cached(engine, rid)
    assert_no_leak(engine)


@pytest.mark.parametrize("change, code, names", [
    (dict(nbytes=1 << 40), "INVALID_ARGUMENT", "header.nbytes"),         # 1 TiB "on the wire" for one block
    (dict(raw_nbytes=1 << 40), "DATA_LOSS", "raw_nbytes"),               # decodes to 1 TiB: not its shape's size
    (dict(codec="zstd-19"), "INVALID_ARGUMENT", "header.codec"),
], ids=["wire-size", "raw-size", "unknown-codec"])
def test_a_declared_size_over_the_limits_is_refused_before_allocation(engine: LLMEngine, change, code, names) -> None:
    """A hand-made stream (correct MAC): one compressed block's header with a size nothing may
    allocate, and a few payload bytes; the receiver refuses on the header (a bytearray of 1 TiB would
    raise MemoryError instead)."""
    rid = f"codec-oversized-{names}-{code}"
    res = engine.reserve(rid, PROMPT, GREEDY)
    block = _blocks(rid, engine)[0]
    header, payload = wire_codec.encode_block(block, "lossless")
    assert header.codec == "lossless"
    for key, value in change.items():
        setattr(header, key, value)
    mac = frames.StreamMac(frames.mac_key(res.transfer_token, CLUSTER), frames.PREFERRED)
    wire = [encode_open(rid, res.transfer_token, mac)]
    piece = memoryview(payload)[:64]
    wire.append(_sealed([*_field(_HEADER, header.SerializeToString()), *_field(_PAYLOAD, piece)], mac))

    async def run():
        async with receiver(engine, CLUSTER) as target:
            return await refusal_of(target, wire)
    err = asyncio.run(run())
    assert err.code() == getattr(grpc.StatusCode, code) and names in err.details(), (err.code(), err.details())
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)
    _nothing_cached(engine, rid)
    assert_no_leak(engine)


def test_auto_goes_off_first_then_lossless_on_a_slow_link(engine: LLMEngine) -> None:
    """The first stream to a target goes off; once the target's estimator holds a rate below the
    lossless break-even (injected through its public observe), the next goes lossless; the sender
    measured the codec's cost itself."""
    sample = _blocks("sample", engine)[0]
    costs = wire_codec.CodecPolicy("auto").costs(sample).by_codec["lossless"]
    slow = costs.break_even_bytes_per_s / 20

    async def run():
        sender = _sender("auto")
        seen = Recorder()
        try:
            first, proxy = await _push(engine, sender, "auto-1", seen)
            assert not isinstance(first, KVTransferError), first
            assert first.codec == "off" and {h.codec for h in seen.headers} == {""}
            engine.abort("auto-1")
            # the relay's next address differs: teach that target's estimator a slow link
            res = engine.reserve("auto-2", PROMPT, GREEDY)
            async with receiver(engine, CLUSTER) as target, relay(target, seen) as proxy2:
                link = sender.codecs.link(proxy2)
                assert link.rate is None
                for _ in range(3):
                    link.observe(64 << 20, (64 << 20) / slow)   # 64 MiB at that rate (over min_bytes)
                seen.headers.clear()
                stream = sender.open(proxy2, "auto-2", res.transfer_token)
                await stream.send(_blocks("auto-2", engine))
                second = await stream.finish(timeout=30)
            return second, seen.headers
        finally:
            await sender.close()
    second, headers = asyncio.run(run())
    assert second.codec == "lossless" and {h.codec for h in headers} == {"lossless"}
    assert second.wire_bytes < second.bytes
    assert engine.kv.state("auto-2") is HandoffState.READY
    assert all(torch.equal(g, s.data) for g, s in zip(_stored(engine, "auto-2"), _blocks("auto-2", engine)))
    engine.abort("auto-2")
    assert_no_leak(engine)


def test_the_policy_and_the_int8_fallback() -> None:
    policy = wire_codec.CodecPolicy("auto")
    block = KVBlock("r", 0, 1, torch.randn(2, 2, 16, 8, 64).to(torch.bfloat16))   # 128 KiB
    assert policy.pick("a", block) == "off"                     # no rate known yet
    policy.observe("a", 64 << 20, (64 << 20) / 100e9)             # 100 GB/s: raw is cheaper
    assert policy.pick("a", block) == "off"
    policy.observe("b", 1 << 20, 1.0)                           # 1 MiB/s
    assert policy.pick("b", block) == "lossless"
    assert wire_codec.CodecPolicy("int8").pick("b", block) == "int8"
    header, payload = wire_codec.encode_block(KVBlock("r", 0, 1, torch.zeros(2, 2, 8, 2, 16, dtype=torch.uint8)),
                                              "int8")
    assert header.codec == "lossless" and header.raw_nbytes == 2 * 2 * 8 * 2 * 16   # int8 cannot take uint8
    with pytest.raises(ValueError, match="kv_compression"):
        wire_codec.CodecPolicy("zstd")


def test_the_flag_is_generated_from_the_worker_config() -> None:
    from pdserve.services.common.config_flags import add_config_args, config_from_args
    assert KV_COMPRESSION_MODES == wire_codec.MODES and WorkerConfig().kv_compression == "auto"
    parser = argparse.ArgumentParser()
    add_config_args(parser, WorkerConfig)
    assert config_from_args(WorkerConfig, parser.parse_args(["--kv-compression", "lossless"])).kv_compression == "lossless"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-compression", "gzip"])


def test_the_prefill_worker_counts_wire_and_raw_bytes_by_codec() -> None:
    metrics = WorkerMetrics("prefill", "p0")
    metrics.kv_sent(3000, 0.01, 2000, "lossless")
    metrics.kv_sent(500, 0.01, 500, "off")
    text = generate_latest(metrics.registry).decode()
    lines = {l.split("{")[0] + ":" + l.split('codec="')[1].split('"')[0]: float(l.split()[-1])
             for l in text.splitlines() if l.startswith("pdserve:kv_") and "_total" in l and "codec=" in l}
    assert lines == {"pdserve:kv_raw_bytes_total:lossless": 3000.0, "pdserve:kv_wire_bytes_total:lossless": 2000.0,
                     "pdserve:kv_raw_bytes_total:off": 500.0, "pdserve:kv_wire_bytes_total:off": 500.0}
    assert wire_codec.CODECS == wire_codec.MODES[1:]


def test_ray_push_blocks_carries_encoded_blocks(engine: LLMEngine) -> None:
    """Ray's push_blocks path in the same shape: the sender encodes (the call's MAC over the encoded
    bytes), the receiver decodes into the reservation; no Ray cluster (the object store's put and the
    actor call are the in-process stand-ins of test_kv_integrity)."""
    rid = "ray-lossless"
    res = engine.reserve(rid, PROMPT, GREEDY)
    receiving = RayKVReceiver(engine.kv, cluster_token=CLUSTER)
    seen: list[kv_pb2.KVBlockHeader] = []

    class Actor:
        class push_blocks:            # noqa: N801 - actor.method.remote(...), as Ray spells it
            @staticmethod
            def remote(opened, headers, refs):
                seen.extend(kv_pb2.KVBlockHeader.FromString(h) for h in headers)
                return asyncio.ensure_future(receiving.push_blocks(opened, headers, refs))

    async def run():
        sender = RayKVSender(put=Resolved, cluster_token=CLUSTER, kv_compression="lossless")
        sender._actors["ray://decode"] = Actor()
        stream = sender.open("ray://decode", rid, res.transfer_token)
        await stream.send(_blocks(rid, engine))
        return await stream.finish(timeout=30)
    result = asyncio.run(run())
    assert result.codec == "lossless" and {h.codec for h in seen} == {"lossless"}
    assert result.wire_bytes == sum(h.nbytes for h in seen) < result.bytes == 8 * engine.runner.kv_bytes_per_block
    assert engine.kv.state(rid) is HandoffState.READY
    assert all(torch.equal(g, s.data) for g, s in zip(_stored(engine, rid), _blocks(rid, engine)))
    engine.abort(rid)
    assert_no_leak(engine)
