"""The receive session every KV transport drives, against a real decode engine's connector, with
no transport and no process: each refusal fails the request and frees its reserved blocks, a
stranger cannot fail someone else's request, and a stream that ends early is data loss."""
from __future__ import annotations

import zlib
from collections import deque

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.engine.kv.handoff import HandoffError, HandoffState
from pdserve.services.kv_transfer import frames
from pdserve.services.kv_transfer.base import KVBlock
from pdserve.services.kv_transfer.frames import encode_wire_frames, parse_frame
from pdserve.services.kv_transfer.receive_session import ReceiveSession, end, take_inline
from pdserve.v1 import kv_pb2
from tests.conftest import assert_no_leak, random_prompts

PROMPT = random_prompts(1, 40, 40, seed=5)[0]          # 5 blocks of 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_qwen3: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", dtype="float32", block_size=8, num_kv_blocks=32))


def _encoded(engine: LLMEngine, rid: str, index: int) -> tuple[kv_pb2.KVBlockHeader, memoryview]:
    hashes = transfer_block_hashes(PROMPT, 8)
    data = torch.randn(engine.runner.block_shape, generator=torch.Generator().manual_seed(index))
    return KVBlock(rid, index, hashes[index], data).encode()


def _opened(engine: LLMEngine, rid: str) -> tuple[ReceiveSession, object]:
    res = engine.reserve(rid, PROMPT, GREEDY)
    session = ReceiveSession(engine.kv)
    session.open(rid, res.transfer_token)
    return session, res


def _refused(session: ReceiveSession, step) -> HandoffError:
    """Run step() as a transport does: a refusal goes to session.fail."""
    with pytest.raises(HandoffError) as err:
        try:
            step()
        except HandoffError as exc:
            session.fail(exc)
            raise
    return err.value


def test_every_block_accepted_makes_the_request_ready_and_is_counted(engine: LLMEngine) -> None:
    session, res = _opened(engine, "all")
    for i in res.needed_block_indices:
        header, payload = _encoded(engine, "all", i)
        session.accept(session.announce(header), payload)
    ack = session.complete()
    assert (ack.blocks_received, ack.bytes_received) == (5, 5 * engine.runner.kv_bytes_per_block)
    assert engine.kv.state("all") is HandoffState.READY
    engine.abort("all")
    assert_no_leak(engine)


@pytest.mark.parametrize("fault, code", [
    ("other-request", "INVALID_ARGUMENT"), ("bad-shape", "DATA_LOSS"), ("wrong-size", "DATA_LOSS"),
    ("checksum", "DATA_LOSS"), ("duplicate", "DATA_LOSS"),
])
def test_a_bad_block_fails_the_request_and_frees_its_blocks(engine: LLMEngine, fault: str, code: str) -> None:
    rid = f"bad-{fault}"
    session, _ = _opened(engine, rid)
    header, payload = _encoded(engine, rid, 0)
    if fault == "duplicate":
        session.accept(session.announce(header), payload)
    elif fault == "other-request":
        header.request_id = "someone-else"
    elif fault == "bad-shape":
        header.shape[-1] += 1     # nbytes no longer matches dtype and shape
    elif fault == "wrong-size":
        payload = payload[:-4]
    elif fault == "checksum":   # a header that carries a CRC-32 (senders' MAC is per frame, checked by the transport)
        header.checksum = zlib.crc32(payload) & 0xFFFFFFFF
        corrupted = bytearray(payload)
        corrupted[3] ^= 0xFF
        payload = memoryview(corrupted)
    err = _refused(session, lambda: session.accept(session.announce(header), payload))
    assert err.code == code, err
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)


def test_a_stream_cancelled_mid_way_frees_what_it_received(engine: LLMEngine) -> None:
    session, _ = _opened(engine, "mid")
    header, payload = _encoded(engine, "mid", 0)
    session.accept(session.announce(header), payload)
    session.announce(_encoded(engine, "mid", 1)[0])   # announced, bytes never come
    session.cancelled()
    assert engine.kv.state("mid") is HandoffState.FAILED
    assert engine.kv.failure("mid").code == "ABORTED"
    assert_no_leak(engine)


def test_a_stream_ending_before_every_block_is_data_loss(engine: LLMEngine) -> None:
    session, _ = _opened(engine, "short")
    header, payload = _encoded(engine, "short", 0)
    session.accept(session.announce(header), payload)
    err = _refused(session, session.complete)
    assert err.code == "DATA_LOSS"
    assert engine.kv.state("short") is HandoffState.FAILED
    assert_no_leak(engine)


def test_a_wrong_token_leaves_the_reservation_alone(engine: LLMEngine) -> None:
    res = engine.reserve("token", PROMPT, GREEDY)
    stranger = ReceiveSession(engine.kv)
    err = _refused(stranger, lambda: stranger.open("token", b"forged"))
    assert err.code == "UNAUTHENTICATED"
    assert engine.kv.state("token") is HandoffState.RESERVED
    owner = ReceiveSession(engine.kv)
    owner.open("token", res.transfer_token)
    owner.heartbeat()
    assert engine.kv.state("token") is HandoffState.RESERVED
    owner.cancelled()
    assert_no_leak(engine)


def test_a_stream_opens_once_and_must_name_its_request(engine: LLMEngine) -> None:
    assert _refused(ReceiveSession(engine.kv), lambda: ReceiveSession(engine.kv).open("", b"")).code == \
        "INVALID_ARGUMENT"
    session, res = _opened(engine, "twice")
    err = _refused(session, lambda: session.open("twice", res.transfer_token))
    assert err.code == "INVALID_ARGUMENT"
    assert engine.kv.state("twice") is HandoffState.FAILED
    assert_no_leak(engine)


class _CallCounts:
    """engine.kv as a sink, counting the connector calls a frame costs."""

    def __init__(self, kv) -> None:
        self.kv, self.calls = kv, []

    def __getattr__(self, name: str):
        attr = getattr(self.kv, name)
        if name in ("check", "check_many", "accept", "accept_many"):
            def counted(*args, **kwargs):
                self.calls.append(name)
                return attr(*args, **kwargs)
            return counted
        return attr


def test_a_frame_of_whole_blocks_costs_one_connector_call_and_a_split_block_takes_the_general_path(
        engine: LLMEngine) -> None:
    for rid, frame_bytes in (("whole-frame", 1 << 30), ("split-frame", 1000)):
        res = engine.reserve(rid, PROMPT, GREEDY)
        sink = _CallCounts(engine.kv)
        session = ReceiveSession(sink)
        session.open(rid, res.transfer_token, frames.PREFERRED)
        sender_mac = frames.StreamMac(session.mac.key, session.mac.name)   # the other end of the stream
        parts = [_encoded(engine, rid, i) for i in res.needed_block_indices]
        pending: deque = deque()
        for raw in encode_wire_frames(parts, frame_bytes, sender_mac):
            take_inline(session, pending, parse_frame(raw))
        assert end(session, pending).blocks_received == len(parts) == 5
        assert engine.kv.state(rid) is HandoffState.READY
        if frame_bytes > 1000:
            assert sink.calls == ["accept_many"]          # checked and written together
        else:
            assert sink.calls[0] == "check_many" and "accept" in sink.calls   # announced, then stored
        engine.abort(rid)
    assert_no_leak(engine)
