"""KV connector (engine/kv/connector.py) state machine on the tiny model, in process:
RESERVED -> RECEIVING -> READY, FAILED, EXPIRED; abort in every state frees the blocks; a lapsed
lease frees; a producer's pinned blocks fall back to the prefix cache on delivery."""
from __future__ import annotations

import time
import zlib

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.kv.handoff import BlockMeta, HandoffError, HandoffState, LeasePolicy
from tests.conftest import assert_no_leak

KW = dict(dtype="float32", block_size=8, num_kv_blocks=32, max_num_batched_tokens=64, max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [(7 * i) % 200 + 3 for i in range(20)]      # 3 blocks, the last one partial


@pytest.fixture   # a fresh pool each test: no prefix cache carried over
def decode(tiny_qwen3: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", **KW), lease=LeasePolicy(idle_s=5.0, max_s=60.0))


@pytest.fixture(scope="module")
def prefill(tiny_qwen3: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_qwen3, role="prefill", **KW))


def block(engine: LLMEngine, rid: str, index: int, seed: int = 0) -> tuple[BlockMeta, bytes]:
    """A well-formed block for a reservation: random bytes with the right layout, hash and CRC."""
    pool = engine.kv.pool
    data = torch.randn(pool.block_shape, generator=torch.Generator().manual_seed(seed + index)).to(pool.dtype)
    raw = data.numpy().tobytes()
    h = engine.kv.receiving[rid].hashes[index]
    return BlockMeta(rid, index, h, pool.dtype_name, tuple(pool.block_shape), len(raw), zlib.crc32(raw)), raw


def send(engine: LLMEngine, rid: str, index: int, token: bytes) -> HandoffState:
    meta, raw = block(engine, rid, index)
    return engine.kv.accept(meta, token, raw)


def test_reserved_receiving_ready_admitted(decode: LLMEngine) -> None:
    res = decode.reserve("ok", PROMPT, GREEDY)
    assert res.needed_block_indices == [0, 1, 2] and res.num_blocks == 3 and res.held_block_hashes == []
    assert decode.kv.state("ok") is HandoffState.RESERVED
    assert decode.stats()["num_reserved"] == 1
    assert decode.stats()["num_free_blocks"] == 32 - 3
    states = [send(decode, "ok", i, res.transfer_token) for i in range(3)]
    assert states == [HandoffState.RECEIVING, HandoffState.RECEIVING, HandoffState.READY]
    stored = decode.runner.read_blocks([decode.kv.receiving["ok"].seq.block_table[1]])[0]
    assert stored.numpy().tobytes() == block(decode, "ok", 1)[1]
    assert decode.admit("ok", 5) is None
    assert decode.kv.state("ok") is None and decode.stats()["num_reserved"] == 0
    while decode.has_unfinished_requests():
        decode.step()
    assert_no_leak(decode)
    # the verified blocks joined the prefix cache: the same prompt needs only its partial block
    again = decode.reserve("again", PROMPT, GREEDY)
    assert again.needed_block_indices == [2] and len(again.held_block_hashes) == 2
    assert decode.abort("again")
    assert_no_leak(decode)


def test_a_refused_block_fails_the_request_and_frees_it(decode: LLMEngine) -> None:
    res = decode.reserve("bad", PROMPT, GREEDY)
    meta, raw = block(decode, "bad", 0)
    with pytest.raises(HandoffError) as err:
        decode.kv.accept(meta, res.transfer_token, raw[:-1] + bytes([raw[-1] ^ 1]))
    assert err.value.code == "DATA_LOSS"
    assert decode.kv.state("bad") is HandoffState.FAILED
    assert decode.kv.failure("bad").code == "DATA_LOSS"
    assert_no_leak(decode)
    with pytest.raises(HandoffError) as err:
        decode.admit("bad", 5)
    assert err.value.code == "DATA_LOSS"


def test_a_wrong_token_is_refused_without_failing_the_request(decode: LLMEngine) -> None:
    res = decode.reserve("tok", PROMPT, GREEDY)
    with pytest.raises(HandoffError) as err:
        send(decode, "tok", 0, b"x" * 16)
    assert err.value.code == "UNAUTHENTICATED"
    with pytest.raises(HandoffError) as err:
        decode.kv.authorize("tok", b"x" * 16)
    assert err.value.code == "UNAUTHENTICATED"
    decode.kv.authorize("tok", res.transfer_token)
    assert decode.kv.state("tok") is HandoffState.RESERVED
    with pytest.raises(HandoffError):
        decode.admit("tok", 5)                      # not READY yet
    assert decode.kv.state("tok") is HandoffState.RESERVED
    assert decode.abort("tok") and not decode.abort("tok")
    assert_no_leak(decode)


@pytest.mark.parametrize("received", [0, 1, 3])   # RESERVED, RECEIVING, READY
def test_abort_in_every_state_frees_the_blocks(decode: LLMEngine, received: int) -> None:
    rid = f"abort{received}"
    res = decode.reserve(rid, PROMPT, GREEDY)
    for i in range(received):
        send(decode, rid, i, res.transfer_token)
    assert decode.kv.state(rid) is (HandoffState.READY if received == 3 else
                                    HandoffState.RECEIVING if received else HandoffState.RESERVED)
    assert decode.abort(rid)
    assert decode.kv.state(rid) is HandoffState.FAILED and decode.kv.failure(rid).code == "ABORTED"
    assert_no_leak(decode)
    with pytest.raises(HandoffError) as err:   # a late block finds why
        decode.kv.accept(BlockMeta(rid, 0, 0, "float32", (), 0, 0), res.transfer_token, b"")
    assert err.value.code == "ABORTED"


def test_a_lapsed_lease_expires_and_frees(decode: LLMEngine) -> None:
    res = decode.reserve("late", PROMPT, GREEDY)
    send(decode, "late", 0, res.transfer_token)
    now = time.monotonic()
    assert decode.kv.expire(now + 1.0) == []
    assert decode.kv.expire(now + 5.1) == ["late"]
    assert decode.kv.state("late") is HandoffState.EXPIRED
    assert decode.kv.failure("late").code == "DEADLINE_EXCEEDED"
    assert_no_leak(decode)


def test_fail_all_ends_every_reception(decode: LLMEngine) -> None:
    decode.reserve("f1", PROMPT, GREEDY)
    decode.reserve("f2", PROMPT[:9], GREEDY)
    decode.kv.fail_all("UNAVAILABLE", "gone")
    assert {decode.kv.failure(r).code for r in ("f1", "f2")} == {"UNAVAILABLE"}
    assert_no_leak(decode)


def test_an_id_in_hand_off_is_in_use(decode: LLMEngine) -> None:
    decode.reserve("busy", PROMPT, GREEDY)
    assert decode.kv.owns("busy")
    with pytest.raises(ValueError, match="in use"):
        decode.add_request("busy", PROMPT, GREEDY)
    decode.abort("busy")
    assert not decode.kv.owns("busy")
    assert_no_leak(decode)


def test_producer_pins_until_delivered_then_blocks_fall_back_to_the_prefix_cache(prefill: LLMEngine) -> None:
    prefill.add_request("p", PROMPT, GREEDY)
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    done = [o for o in outs if o.prefill_done]
    assert len(done) == 1 and len(done[0].new_token_ids) == 1
    assert sorted(i for o in outs for i in o.ready_blocks) == [0, 1, 2]   # every block exported once
    stats = prefill.stats()
    assert stats["num_pinned"] == 1 and stats["num_free_blocks"] == 32 - 3
    pieces = prefill.kv.read_block_pieces("p", [0, 1, 2])
    assert len(pieces) == 1 and pieces[0][2].shape[0] == 3
    assert prefill.release("p") and not prefill.release("p")
    assert prefill.stats()["num_pinned"] == 0
    assert_no_leak(prefill)
    assert prefill.kv.read_block_pieces("p", [0]) is None
    # the delivered blocks stayed cached: the same prompt finds its two full blocks computed
    prefill.add_request("p2", PROMPT, GREEDY)
    outs = prefill.step()
    assert outs[0].num_cached_tokens == 16
    assert prefill.abort("p2")                       # a pinned request aborts like a delivered one
    assert_no_leak(prefill)


def test_a_lapsed_pin_is_freed(prefill: LLMEngine) -> None:
    prefill.add_request("stale", PROMPT, GREEDY)
    while prefill.has_unfinished_requests():
        prefill.step()
    assert prefill.stats()["num_pinned"] == 1
    assert prefill.kv.expire(time.monotonic() + prefill.kv.lease.max_s + 1) == ["stale"]
    assert prefill.stats()["num_pinned"] == 0
    assert_no_leak(prefill)
