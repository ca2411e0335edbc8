"""Frames of whole blocks and the runs of blocks the receiver stores at once: where the sender
cuts frames (frames.iter_wire_frames with a target), that it seals each frame as it is taken,
and the connector's accept_many (every block checked before any is written, one pool copy per
run, a refusal failing the whole request and freeing it)."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.engine.kv.handoff import HandoffError, HandoffState
from pdserve.services.kv_transfer import KVBlock, frames
from pdserve.services.kv_transfer.base import block_meta
from pdserve.services.kv_transfer.frames import iter_wire_frames, parse_frame
from tests.conftest import assert_no_leak, random_prompts

PROMPT = random_prompts(1, 60, 60, seed=78)[0]          # 8 blocks of 8 (the last one partial)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _raw_blocks(sizes: list[int]) -> list[KVBlock]:
    return [KVBlock("r", i, 100 + i, torch.full((n // 4,), float(i))) for i, n in enumerate(sizes)]


def _layout(frames: list[bytes]) -> list[tuple[list[int], int]]:
    """Per frame: the block indices it announces and its payload bytes."""
    parsed = [parse_frame(f) for f in frames]
    assert not any(p.error for p in parsed)
    return [([h.block_index for h in p.headers], p.payload.nbytes) for p in parsed]


def test_frames_hold_whole_blocks_up_to_the_target() -> None:
    blocks = _raw_blocks([96] * 7)
    frames = list(iter_wire_frames([b.encode() for b in blocks], 1000, None, target_bytes=300))
    assert _layout(frames) == [([0, 1, 2], 288), ([3, 4, 5], 288), ([6], 96)]
    payload = b"".join(bytes(parse_frame(f).payload) for f in frames)
    assert payload == b"".join(b.data.numpy().tobytes() for b in blocks)


def test_a_block_beyond_the_target_has_a_frame_and_one_beyond_the_limit_spans_frames() -> None:
    blocks = _raw_blocks([96, 600, 96, 2400, 96])
    frames = list(iter_wire_frames([b.encode() for b in blocks], 1000, None, target_bytes=300))
    assert _layout(frames) == [([0], 96), ([1], 600), ([2], 96), ([3], 1000), ([], 1000), ([], 400), ([4], 96)]
    assert b"".join(bytes(parse_frame(f).payload) for f in frames) == b"".join(b.data.numpy().tobytes()
                                                                                for b in blocks)


def test_without_a_target_payloads_run_on_across_frames() -> None:
    frames = list(iter_wire_frames([b.encode() for b in _raw_blocks([96] * 3)], 150))
    assert [n for _, n in _layout(frames)] == [150, 138]


def test_each_frame_is_sealed_when_it_is_taken() -> None:
    """Frames leave as they are sealed: the MAC counter advances with each frame taken, not
    all at once, and every frame verifies in order."""
    key = frames.mac_key(b"token", "cluster")
    mac = frames.StreamMac(key, frames.PREFERRED)
    wire = iter_wire_frames([b.encode() for b in _raw_blocks([96] * 6)], 1000, mac, target_bytes=200)
    taken = [next(wire)]
    assert mac.counter == 1
    taken += list(wire)
    assert mac.counter == len(taken) == 3
    check = frames.StreamMac(key, frames.PREFERRED)
    for f in taken:
        p = parse_frame(f)
        check.verify([p.signed], p.mac, "test")


def _reserved(engine: LLMEngine, rid: str) -> tuple[bytes, list[KVBlock]]:
    res = engine.reserve(rid, PROMPT, GREEDY)
    assert res.needed_block_indices == list(range(8))
    hashes = transfer_block_hashes(PROMPT, 8)
    g = torch.Generator().manual_seed(3)
    return res.transfer_token, [KVBlock(rid, i, hashes[i], torch.randn(engine.runner.block_shape, generator=g))
                                for i in range(8)]


def _run_of(blocks: list[KVBlock]) -> tuple[list, bytes]:
    encoded = [b.encode() for b in blocks]
    return [block_meta(h) for h, _ in encoded], b"".join(bytes(p) for _, p in encoded)


def test_a_run_of_blocks_lands_bit_exact_and_the_request_becomes_ready(engine: LLMEngine) -> None:
    rid = "run-exact"
    token, blocks = _reserved(engine, rid)
    metas, payload = _run_of(blocks[:5])
    assert engine.kv.accept_many(metas, token, payload) is HandoffState.RECEIVING
    metas, payload = _run_of(blocks[5:])
    assert engine.kv.accept_many(metas, token, payload) is HandoffState.READY
    stored = engine.runner.read_blocks(engine.kv.receiving[rid].seq.block_table)
    for j, block in enumerate(blocks):
        assert torch.equal(stored[j], block.data)
    engine.abort(rid)
    assert_no_leak(engine)


def test_write_blocks_puts_each_block_in_its_place_in_any_order(engine: LLMEngine) -> None:
    """The runner's one copy per run, for block ids in no order (a slice copy per consecutive run) and consecutive
    ones (a slice), lands each block where a per-block write would."""
    runner = engine.runner
    g = torch.Generator().manual_seed(5)
    for ids in ([9, 3, 20, 4], [30, 31, 32]):
        data = torch.randn((len(ids), *runner.block_shape), generator=g)
        runner.write_blocks(ids, data)
        assert torch.equal(runner.read_blocks(ids), data)


@pytest.mark.parametrize("fault", ["twice-in-a-run", "short-payload", "wrong-hash-inside"])
def test_a_bad_run_fails_the_whole_request_and_frees_it(engine: LLMEngine, fault: str) -> None:
    rid = f"run-{fault}"
    token, blocks = _reserved(engine, rid)
    metas, payload = _run_of(blocks[:3])
    if fault == "twice-in-a-run":
        metas, payload = _run_of([blocks[0], blocks[1], blocks[1]])
    elif fault == "short-payload":
        payload = payload[:-4]
    else:
        blocks[1].block_hash ^= 1
        metas, payload = _run_of(blocks[:3])
    with pytest.raises(HandoffError) as err:
        engine.kv.accept_many(metas, token, payload)
    assert err.value.code == "DATA_LOSS"
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)   # nothing written reaches the prefix cache: the request never became READY


def test_a_frames_headers_are_checked_together_before_any_byte(engine: LLMEngine) -> None:
    """check_many (a frame's headers, one lock): a block announced twice in one frame is refused
    before any payload is read, and that fails the request; headers of two requests in one call
    are refused without touching either."""
    rid = "announced-twice"
    token, blocks = _reserved(engine, rid)
    metas = [block_meta(b.encode()[0]) for b in (blocks[0], blocks[1], blocks[1])]
    assert engine.kv.check_many(metas[:2], token).request_id == rid   # each once: fine, nothing changes
    assert engine.kv.state(rid) is HandoffState.RESERVED
    with pytest.raises(HandoffError) as err:
        engine.kv.check_many(metas, token)
    assert err.value.code == "DATA_LOSS" and "overlap" in str(err.value)
    assert engine.kv.state(rid) is HandoffState.FAILED

    other_token, other = _reserved(engine, "announced-beside")
    mixed = [block_meta(other[0].encode()[0]), metas[0]]
    with pytest.raises(HandoffError) as err:
        engine.kv.check_many(mixed, other_token)
    assert err.value.code == "INVALID_ARGUMENT"
    assert engine.kv.state("announced-beside") is HandoffState.RESERVED
    engine.abort("announced-beside")
    assert_no_leak(engine)


def _write(run, blocks: list[KVBlock]) -> None:
    """What the TCP receiver does with a claimed run: the blocks' bytes straight into its slabs."""
    payload = b"".join(bytes(b.encode()[1]) for b in blocks)
    at = 0
    for slab in run.slabs:
        slab[:] = payload[at:at + slab.nbytes]
        at += slab.nbytes
    assert at == len(payload) == run.nbytes


def test_a_claimed_run_is_written_in_place_and_counts_only_once_finished(engine: LLMEngine) -> None:
    """claim_run hands out the blocks' own bytes in the pool (in the wire's order: a block's layers'
    K and V slabs); they count as received only at finish_run, and no other stream may deliver
    them in between (refused as overlapping: the request fails)."""
    rid = "claimed"
    token, blocks = _reserved(engine, rid)
    run = engine.kv.claim_run(_run_of(blocks[:5])[0], token)
    assert len(run.slabs) == 5 * 2 * engine.runner.block_shape[0]
    _write(run, blocks[:5])
    assert engine.kv.state(rid) is HandoffState.RESERVED             # written, not yet verified
    assert engine.kv.finish_run(run, written=True) is HandoffState.RECEIVING
    run = engine.kv.claim_run(_run_of(blocks[5:])[0], token)
    _write(run, blocks[5:])
    assert engine.kv.finish_run(run, written=True) is HandoffState.READY
    stored = engine.runner.read_blocks(engine.kv.receiving[rid].seq.block_table)
    for j, block in enumerate(blocks):
        assert torch.equal(stored[j], block.data)
    engine.abort(rid)

    rid = "claimed-twice"
    token, blocks = _reserved(engine, rid)
    run = engine.kv.claim_run(_run_of(blocks[:2])[0], token)
    with pytest.raises(HandoffError) as err:
        engine.kv.check_many([block_meta(blocks[1].encode()[0])], token)
    assert err.value.code == "DATA_LOSS" and "overlap" in str(err.value)
    with pytest.raises(HandoffError):   # the request failed while the run was being written
        engine.kv.finish_run(run, written=False)
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert_no_leak(engine)


def test_a_request_ended_mid_write_keeps_its_blocks_until_the_writer_is_done(engine: LLMEngine) -> None:
    """Aborted (or lapsed) while a claimed run is written outside the lock: its blocks are not freed
    (another request could be given them mid-write) until finish_run, which then raises why."""
    rid = "ended-mid-write"
    token, blocks = _reserved(engine, rid)
    free_before = engine.stats()["num_free_blocks"]
    run = engine.kv.claim_run(_run_of(blocks)[0], token)
    engine.abort(rid)
    assert engine.kv.state(rid) is HandoffState.FAILED
    assert engine.stats()["num_free_blocks"] == free_before           # still held for the writer
    _write(run, blocks)
    with pytest.raises(HandoffError) as err:
        engine.kv.finish_run(run, written=True)
    assert err.value.code == "ABORTED"
    assert_no_leak(engine)


def test_a_frames_head_is_parsed_from_its_first_bytes() -> None:
    """parse_head: None until the bytes before the payload are in; then the headers and where the
    payload lies; a frame without a payload (the open frame) says so; the trailer is the MAC."""
    from pdserve.services.kv_transfer.frames import encode_open, parse_head, parse_trailer
    mac = frames.StreamMac(b"k" * 32, frames.PREFERRED)
    blocks = _raw_blocks([64] * 100)    # 100 headers: more than one first read of the receiver's
    frame = next(iter_wire_frames([b.encode() for b in blocks], 1 << 20, mac, target_bytes=1 << 20))
    view = memoryview(frame)
    parsed = parse_frame(frame)
    at = parsed.signed.nbytes - parsed.payload.nbytes
    assert parse_head(view[:at - 2], len(frame)) is None
    head = parse_head(view[:at], len(frame))
    assert [h.block_index for h in head.frame.headers] == list(range(100))
    assert (head.payload_at, head.payload_len) == (at, 6400)
    assert parse_trailer(view[at + 6400:]) == parsed.mac
    opened = encode_open("r", b"t" * 16, frames.StreamMac(b"k" * 32, frames.PREFERRED))
    assert parse_head(memoryview(opened), len(opened)).payload_at == -1
    with pytest.raises(ValueError):
        parse_trailer(view[at + 6399:])
