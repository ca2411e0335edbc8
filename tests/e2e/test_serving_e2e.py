"""End to end over real processes and real gRPC on loopback: router + prefill + decode."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.services.client import AsyncClient, Client, build_request
from pdserve.services.kv_transfer import GrpcKVSender, KVBlock, KVTransferError
from tests.conftest import hf_greedy, random_prompts
from tests.serving import (aio_channel, assert_blocks_at_baseline, channel, metric, scrape, start_cluster,
                           worker_status, workers)

PROMPTS = random_prompts(8, 5, 60, seed=31)
MAX_NEW = 12


@pytest.fixture(scope="module")
def offline_reference(tiny_qwen3: str) -> list[list[int]]:
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512)
    outs = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))]
    assert outs == hf_greedy(tiny_qwen3, PROMPTS, MAX_NEW)
    return outs


@pytest.fixture(scope="module")
def cluster_1p1d(tiny_qwen3: str):
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1)
    yield cluster
    cluster.stop()


async def _generate_all(address: str, prompts: list[list[int]], **kwargs):
    async with AsyncClient(address, timeout=60) as client:
        return await asyncio.gather(*(client.generate(p, **kwargs) for p in prompts))


def test_concurrent_greedy_matches_offline_1p1d(cluster_1p1d, offline_reference) -> None:
    outs = asyncio.run(_generate_all(cluster_1p1d.router_address, PROMPTS, max_tokens=MAX_NEW, temperature=0.0,
                                     ignore_eos=True))
    assert [o.token_ids for o in outs] == offline_reference
    for o, p in zip(outs, PROMPTS):
        assert o.finish_reason == "length"
        assert o.usage["prompt_tokens"] == len(p) and o.usage["completion_tokens"] == MAX_NEW
        assert 0 < o.timings["ttft_ms"] <= o.timings["e2e_ms"]
    assert_blocks_at_baseline(cluster_1p1d)


def test_concurrent_greedy_matches_offline_2p2d(tiny_qwen3: str, offline_reference) -> None:
    cluster = start_cluster(tiny_qwen3, prefill_workers=2, decode_workers=2)
    try:
        outs = asyncio.run(_generate_all(cluster.router_address, PROMPTS, max_tokens=MAX_NEW, temperature=0.0,
                                         ignore_eos=True))
        assert [o.token_ids for o in outs] == offline_reference
        # every worker took part
        for proc in cluster.processes:
            if proc.name != "router":
                assert metric(scrape(proc.metrics_address), "pdserve:generation_tokens_total") > 0, proc.name
        assert_blocks_at_baseline(cluster)
    finally:
        cluster.stop()


def test_colocated_gives_same_tokens(tiny_qwen3: str, offline_reference) -> None:
    cluster = start_cluster(tiny_qwen3, colocated_workers=1)
    try:
        outs = asyncio.run(_generate_all(cluster.router_address, PROMPTS, max_tokens=MAX_NEW, temperature=0.0,
                                         ignore_eos=True))
        assert [o.token_ids for o in outs] == offline_reference
        assert_blocks_at_baseline(cluster)
    finally:
        cluster.stop()


def test_text_prompt_streams_text(cluster_1p1d) -> None:
    with Client(cluster_1p1d.router_address, timeout=30) as client:
        chunks = list(client.generate_stream("The quick brown fox", max_tokens=8, temperature=0.0, ignore_eos=True))
        info = client.model_info()
    assert len(chunks) >= 2 and chunks[-1].finished
    assert sum(len(c.token_ids) for c in chunks) == 8
    assert info.vocab_size == 1024 and info.num_prefill_workers == 1 and info.num_decode_workers == 1


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": [], "max_tokens": 4}, "prompt"),
    ({"prompt": [5, 4096], "max_tokens": 4}, "vocabulary"),
    ({"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"prompt": [5, 6], "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"prompt": [5, 6], "max_tokens": 4, "top_k": -2}, "top_k"),
    ({"prompt": [5] * 2000, "max_tokens": 100}, "max_model_len"),
])
def test_invalid_requests_are_rejected_and_service_stays_up(cluster_1p1d, kwargs, field) -> None:
    with Client(cluster_1p1d.router_address, timeout=30) as client:
        prompt = kwargs.pop("prompt")
        with pytest.raises(grpc.RpcError) as err:
            client.generate(prompt, **kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        assert len(client.generate([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True).token_ids) == 3


def test_cancel_mid_stream_frees_blocks(cluster_1p1d) -> None:
    async def run() -> None:
        async with AsyncClient(cluster_1p1d.router_address, timeout=60) as client:
            stream = client.stub.Generate(build_request(PROMPTS[0], max_tokens=1000, temperature=0.0, ignore_eos=True))
            got = 0
            async for msg in stream:
                got += len(msg.token_ids)
                if got >= 3:
                    stream.cancel()
                    break
            assert got >= 3
    asyncio.run(run())
    assert_blocks_at_baseline(cluster_1p1d)


def test_decode_many_answers_each_request_on_its_own_and_gives_refused_blocks_back(cluster_1p1d) -> None:
    """One DecodeMany stream, two requests that cannot start: each ends with the status Decode
    would fail with (no reservation; KV that never came), the stream ends once both did, and the
    reservation whose KV never came is given back."""
    decode = workers(cluster_1p1d, "decode")[0]
    controls = [worker_pb2.DecodeControl(),
                worker_pb2.DecodeControl(start=worker_pb2.DecodeRequest(request_id="mux-ghost", first_token_id=5)),
                worker_pb2.DecodeControl(start=worker_pb2.DecodeRequest(request_id="mux-held", first_token_id=5,
                                                                        kv_wait_ms=300))]

    async def run() -> list[worker_pb2.DecodeEvent]:
        async with aio_channel(cluster_1p1d, decode) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            await stub.Reserve(worker_pb2.ReserveRequest(request_id="mux-held", prompt_token_ids=PROMPTS[0],
                                                         params=common_pb2.SamplingParams(max_tokens=4)), timeout=10)
            return [e async for batch in stub.DecodeMany(iter(controls), timeout=30) for e in batch.events]
    events = asyncio.run(run())
    ended = {e.request_id: (grpc.StatusCode.NOT_FOUND.value[0] == e.error_code and "NOT_FOUND"
                            or grpc.StatusCode.DEADLINE_EXCEEDED.value[0] == e.error_code and "DEADLINE_EXCEEDED",
                            e.error_message, e.finished) for e in events}
    assert ended == {"mux-ghost": ("NOT_FOUND", "no reservation for request 'mux-ghost'", True),
                     "mux-held": ("DEADLINE_EXCEEDED", "KV of 'mux-held' incomplete after waiting 0.3s", True)}, events
    assert_blocks_at_baseline(cluster_1p1d)


def test_router_abort_ends_stream_with_abort(cluster_1p1d) -> None:
    async def run() -> str | None:
        async with AsyncClient(cluster_1p1d.router_address, timeout=60) as client:
            last = None
            async for msg in client.generate_stream(PROMPTS[1], request_id="to-abort", max_tokens=1500,
                                                    temperature=0.0, ignore_eos=True):
                if len(msg.token_ids) and last is None:
                    assert await client.abort("to-abort")
                last = msg
            return last.finish_reason if last.finished else None
    assert asyncio.run(run()) == "abort"
    assert_blocks_at_baseline(cluster_1p1d)


def test_shared_prefix_sends_fewer_kv_bytes(cluster_1p1d) -> None:
    prefix = random_prompts(1, 160, 160, seed=41)[0]
    # The decode worker counts KV bytes as blocks land, before it can admit the request: exact
    # by the time the request's tokens arrive.
    decode = next(p for p in cluster_1p1d.processes if p.name.startswith("decode"))
    before = metric(scrape(decode.metrics_address), "pdserve:kv_transfer_bytes_total")
    with Client(cluster_1p1d.router_address, timeout=30) as client:
        first = client.generate(prefix + [7, 8, 9], max_tokens=4, temperature=0.0, ignore_eos=True)
        mid = metric(scrape(decode.metrics_address), "pdserve:kv_transfer_bytes_total")
        second = client.generate(prefix + [10, 11], max_tokens=4, temperature=0.0, ignore_eos=True)
    after = metric(scrape(decode.metrics_address), "pdserve:kv_transfer_bytes_total")
    first_bytes, second_bytes = mid - before, after - mid
    block_bytes = 2 * 2 * 8 * 2 * 32 * 4   # layers, K+V, block, kv heads, head_dim, float32
    assert first_bytes == 21 * block_bytes        # 163 tokens in blocks of 8
    assert second_bytes == 1 * block_bytes        # only the block after the 160 shared tokens
    assert second.usage["cached_tokens"] == 160
    assert first.usage["cached_tokens"] == 0


def test_a_sessions_next_turn_prefills_only_its_new_tokens_on_the_decode_worker(cluster_1p1d, tiny_qwen3) -> None:
    """Turn 2 of a session (history + turn 1's answer + a new message) goes back to the decode
    worker that served turn 1 and prefills there: only the tokens past the blocks it holds are
    computed (nothing is shipped), with the tokens the offline engine gives the whole prompt.
    The same turn without a session is prefilled remotely, as --disaggregation always says."""
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    history = random_prompts(1, 100, 100, seed=61)[0]
    message = random_prompts(1, 12, 12, seed=62)[0]
    with Client(cluster_1p1d.router_address, timeout=30) as client:
        kwargs = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
        turn1 = client.generate(history, session_id="conversation-1", **kwargs)
        assert turn1.timings["prefill_route"] == "remote"
        prompt2 = history + turn1.token_ids + message
        # kept: the decode worker's KV events of turn 1 reach the router; its prefix index has no
        # outside view (no metric or RPC) to wait on
        time.sleep(0.3)
        turn2 = client.generate(prompt2, session_id="conversation-1", **kwargs)
        alone = client.generate(prompt2[:-1] + [prompt2[-1] ^ 1], **kwargs)   # no session, another last token
    held = (len(history) + len(turn1.token_ids) - 1) // 8 * 8   # its full blocks, the last token's K/V not yet
    assert turn2.timings["prefill_route"] == "local", turn2.timings
    assert turn2.usage["cached_tokens"] == held and turn2.timings["kv_bytes"] == 0, (turn2.usage, turn2.timings)
    assert alone.timings["prefill_route"] == "remote"
    assert turn1.token_ids == llm.generate([history], greedy)[0].token_ids
    assert turn2.token_ids == llm.generate([prompt2], greedy)[0].token_ids
    assert_blocks_at_baseline(cluster_1p1d)


def test_corrupted_block_is_refused(cluster_1p1d) -> None:
    decode_addr = workers(cluster_1p1d, "decode")[0]
    prompt = random_prompts(1, 20, 20, seed=51)[0]
    status = worker_status(cluster_1p1d, decode_addr)
    shape = (status.num_layers, 2, status.block_size, status.num_kv_heads, status.head_dim)

    async def run() -> None:
        async with aio_channel(cluster_1p1d, decode_addr) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            res = await stub.Reserve(worker_pb2.ReserveRequest(request_id="corrupt", prompt_token_ids=prompt,
                                                               params=common_pb2.SamplingParams(max_tokens=4)))
            assert list(res.needed_block_indices) == [0, 1, 2]
            hashes = transfer_block_hashes(prompt, status.block_size)
            # a sender without the cluster token (its proof and MACs use another key) is refused at its first frame
            other = await stub.Reserve(worker_pb2.ReserveRequest(request_id="stranger", prompt_token_ids=prompt,
                                                                 params=common_pb2.SamplingParams(max_tokens=4)))
            stranger = GrpcKVSender(lambda a: aio_channel(cluster_1p1d, a), cluster_token="not-the-cluster-token")
            stream = stranger.open(decode_addr, "stranger", other.transfer_token)
            await stream.send([KVBlock("stranger", 0, hashes[0], torch.zeros(shape))])
            with pytest.raises(KVTransferError) as refused:
                await stream.finish(timeout=10)
            # grpcio can lose the status of a stream refused while a write was in flight
            # (grpc/grpc#36066, see tests/e2e/test_security.py): INTERNAL then, and the
            # reservation's state below still holds the worker to the refusal
            lost = refused.value.code == "INTERNAL" and "Internal error from Core" in str(refused.value)
            assert refused.value.code == "UNAUTHENTICATED" or lost, refused.value
            await stranger.close()
            assert worker_status(cluster_1p1d, decode_addr).num_reserved == 2   # nothing of the stranger's admitted
            # refused before its first frame was read: the reservation (this test's own) waits for
            # its lease, so the test frees it
            assert (await worker_pb2_grpc.WorkerStub(ch).Abort(common_pb2.AbortRequest(request_id="stranger"))).found
            creds = cluster_1p1d.spec.credentials   # as a prefill worker sends: its own proof per stream
            sender = GrpcKVSender(lambda a: creds.channel(a, attach_token=False), proof=creds.call_proof,
                                  cluster_token=creds.cluster_token)
            stream = sender.open(decode_addr, "corrupt", res.transfer_token)
            await stream.send([KVBlock("corrupt", 0, hashes[0] ^ 1, torch.zeros(shape))])
            with pytest.raises(KVTransferError) as refused:
                await stream.finish(timeout=10)
            assert refused.value.code == "DATA_LOSS" and "chain hash" in str(refused.value), refused.value
            await sender.close()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Decode(worker_pb2.DecodeRequest(request_id="corrupt", first_token_id=5)):
                    pass
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
    asyncio.run(run())
    assert_blocks_at_baseline(cluster_1p1d)
    with Client(cluster_1p1d.router_address, timeout=30) as client:   # still serving
        assert len(client.generate(prompt, max_tokens=3, temperature=0.0, ignore_eos=True).token_ids) == 3


def test_client_deadline_aborts_everywhere(cluster_1p1d) -> None:
    with Client(cluster_1p1d.router_address, timeout=0.5) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPTS[2], max_tokens=1900, temperature=0.0, ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_blocks_at_baseline(cluster_1p1d)


def test_reservation_without_prefill_expires(tiny_qwen3: str) -> None:
    cluster = start_cluster(tiny_qwen3, worker_args=["--kv-lease-idle-s", "0.3"])
    try:
        decode_addr = workers(cluster, "decode")[0]
        with channel(cluster, decode_addr) as ch:
            res = worker_pb2_grpc.DecodeWorkerStub(ch).Reserve(worker_pb2.ReserveRequest(
                request_id="orphan", prompt_token_ids=PROMPTS[3], params=common_pb2.SamplingParams(max_tokens=4)),
                timeout=10)
        assert res.num_blocks > 0 and res.lease_ms == 300
        status = worker_status(cluster, decode_addr)
        assert status.num_free_blocks == status.num_total_blocks - res.num_blocks
        assert_blocks_at_baseline(cluster, timeout=3.0)
    finally:
        cluster.stop()


def test_the_first_token_arrives_before_the_kv_is_acknowledged(tiny_qwen3: str) -> None:
    """The prefill worker's sampled token reaches the client at once, while its KV blocks are still
    on their way: here the decode worker is frozen after its reservation, so no block can be
    acknowledged, and the token arrives anyway. Once it resumes, the request completes exactly."""
    import os
    import signal

    from tests.faults.harness import observe, wait_for

    c = start_cluster(tiny_qwen3, engine_args=["--block-size", "8", "--num-kv-blocks", "512", "--dtype", "float32",
                                               "--max-num-batched-tokens", "8"])
    try:
        decode = next(p for p in c.processes if p.name.startswith("decode"))
        prompt = random_prompts(1, 1500, 1500, seed=81)[0]
        obs = observe(c.router_address, prompt, 6)
        wait_for(lambda: worker_status(c, decode.address).num_reserved == 1, 30, "the reservation")
        os.kill(decode.popen.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: bool(obs.tokens), 30, "the first token, with the decode worker frozen")
            assert not obs.done.is_set()
        finally:
            os.kill(decode.popen.pid, signal.SIGCONT)
        assert obs.done.wait(60) and obs.code is None
        assert obs.tokens == hf_greedy(tiny_qwen3, [prompt], 6)[0]
        assert obs.migrations == 0
        assert_blocks_at_baseline(c)
    finally:
        c.stop()
