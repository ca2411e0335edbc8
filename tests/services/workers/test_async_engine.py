"""AsyncEngine (services/workers/async_engine.py) on the tiny model, in process: submit, stream, abort,
shutdown, errors propagate to the caller, no leaked blocks."""
from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.engine import EngineConfig, LLM, SamplingParams
from pdserve.engine.kv.handoff import HandoffError, HandoffState
from pdserve.services.workers.async_engine import AsyncEngine
from tests.conftest import assert_no_leak

KW = dict(dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=256)
PROMPTS = [[3, 14, 15, 92, 65, 35], [27, 18, 28, 18, 28, 45, 90, 45]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def run(config: EngineConfig, body) -> None:
    async def main() -> None:
        aengine = AsyncEngine(config)
        aengine.start()
        try:
            await body(aengine)
        finally:
            aengine.stop()
        assert not aengine._thread.is_alive()
        assert_no_leak(aengine.engine)
    asyncio.run(main())


async def collect(stream) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    async with stream:
        while not stream.finished:
            res = await stream.get(timeout=30)
            tokens += res.output.new_token_ids
            reason = res.output.finish_reason
    return tokens, reason


def test_concurrent_streams_match_the_offline_engine(tiny_qwen3: str) -> None:
    expected = [o.token_ids for o in LLM(tiny_qwen3, **KW).generate(PROMPTS, GREEDY)]

    async def body(aengine: AsyncEngine) -> None:
        streams = [aengine.add(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        got = await asyncio.gather(*(collect(s) for s in streams))
        assert [t for t, _ in got] == expected
        assert [r for _, r in got] == ["length", "length"]
    run(EngineConfig(model=tiny_qwen3, **KW), body)


def test_abort_ends_the_stream_and_frees_blocks(tiny_qwen3: str) -> None:
    async def body(aengine: AsyncEngine) -> None:
        stream = aengine.add("long", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        first = await stream.get(timeout=30)
        assert first.output.new_token_ids and not first.output.finished
        assert aengine.abort("long")
        while not stream.finished:
            res = await stream.get(timeout=30)
        assert res.output.finish_reason == "abort"
        assert not aengine.abort("long")
        for _ in range(100):   # a step running while it was aborted frees its blocks when it ends
            if not aengine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
    run(EngineConfig(model=tiny_qwen3, **KW), body)


def test_leaving_the_stream_early_aborts_the_request(tiny_qwen3: str) -> None:
    async def body(aengine: AsyncEngine) -> None:
        async with aengine.add("left", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=200,
                                                                  ignore_eos=True)) as stream:
            await stream.get(timeout=30)
        assert "left" not in aengine.engine.requests
        for _ in range(500):   # the step running when it left ends, and frees its blocks
            if not aengine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not aengine.engine.has_unfinished_requests()
    run(EngineConfig(model=tiny_qwen3, **KW), body)


def test_errors_propagate_and_the_engine_keeps_serving(tiny_qwen3: str) -> None:
    async def body(aengine: AsyncEngine) -> None:
        with pytest.raises(ValueError, match="vocabulary"):
            aengine.add("bad", [5, 10 ** 7], GREEDY)
        with pytest.raises(ValueError, match="max_tokens"):
            aengine.add("bad", [5], SamplingParams(max_tokens=0))
        stream = aengine.add("dup", PROMPTS[0], GREEDY)
        with pytest.raises(ValueError, match="in use"):
            aengine.add("dup", PROMPTS[0], GREEDY)
        with pytest.raises(HandoffError) as err:
            aengine.admit("nobody", 5)
        assert err.value.code == "NOT_FOUND"
        tokens, reason = await collect(stream)
        assert len(tokens) == 6 and reason == "length"
    run(EngineConfig(model=tiny_qwen3, **KW), body)


def test_a_reservation_waits_until_ready_or_fails(tiny_qwen3: str) -> None:
    async def body(aengine: AsyncEngine) -> None:
        engine = aengine.engine
        engine.reserve("kv", PROMPTS[1], GREEDY)
        waiter = asyncio.ensure_future(aengine.wait_kv("kv", timeout=10))
        await asyncio.sleep(0.05)   # kept: a window in which nothing may happen (the waiter keeps waiting)
        assert not waiter.done()
        assert engine.kv.fail("kv", "UNAVAILABLE", "the stream broke")
        assert await waiter in (None, HandoffState.FAILED)
        assert engine.kv.failure("kv").code == "UNAVAILABLE"
    run(EngineConfig(model=tiny_qwen3, role="decode", **KW), body)


def test_shutdown_with_requests_in_flight(tiny_qwen3: str) -> None:
    async def main() -> None:
        aengine = AsyncEngine(EngineConfig(model=tiny_qwen3, **KW))
        aengine.start()
        stream = aengine.add("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        first = await stream.get(timeout=30)   # it runs: the engine stops under it
        assert first.output.new_token_ids and not first.output.finished
        aengine.stop()
        assert not aengine._thread.is_alive()
        assert aengine.engine.abort("a")
        assert_no_leak(aengine.engine)
    asyncio.run(main())


def test_a_large_finished_prefill_sends_its_token_before_any_copy_of_its_kv(tiny_qwen3: str,
                                                                           monkeypatch) -> None:
    """A finished prefill's KV beyond export_run_bytes is not copied before its first token is
    delivered: export_blocks then gives views of the pinned blocks to a sender that takes them
    (else, or where the pool gives none, a copy), with the same bytes; after release, nothing."""
    prompt = list(range(3, 43))   # 5 blocks of 8

    async def body(aengine: AsyncEngine) -> None:
        aengine.export_run_bytes = aengine.connector.bytes_per_block * 2
        stream = aengine.add("p", prompt, SamplingParams(temperature=0.0, max_tokens=1))
        async with stream:
            res = await stream.get(timeout=30)
        assert res.output.prefill_done and res.output.ready_blocks == [0, 1, 2, 3, 4]
        assert res.blocks is None                                   # not copied before the token
        want = aengine.engine.kv.read_block_pieces("p", [1, 3])[0][2]
        (start, end, views), = await aengine.export_blocks("p", [1, 3], views=True)
        assert (start, end) == (0, want.shape[4])
        assert all(torch.equal(v, w) for v, w in zip(views, want))
        (_, _, copied), = await aengine.export_blocks("p", [1, 3])   # a sender that needs its own copy
        assert torch.equal(copied, want)
        monkeypatch.setattr(aengine.engine.runner, "block_views", lambda ids: None)
        (_, _, copied), = await aengine.export_blocks("p", [1, 3], views=True)   # no views here: a copy
        assert torch.equal(copied, want)
        assert aengine.engine.release("p")
        assert await aengine.export_blocks("p", [1, 3]) is None
    run(EngineConfig(model=tiny_qwen3, role="prefill", **KW), body)
