"""End to end over real processes on loopback, with the KV hand-off on each data plane: the raw
TCP connection (the decode worker's --kv-data-port, named in its reservations) and the gRPC
stream (--kv-data-plane grpc: nothing named, KV inline over gRPC). Same greedy tokens as the
offline engine either way; blocks back at baseline after finished and aborted requests."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.services.client import AsyncClient
from tests.conftest import random_prompts
from tests.serving import assert_blocks_at_baseline, channel, start_cluster, workers

PROMPTS = random_prompts(4, 20, 90, seed=37)
MAX_NEW = 8


@pytest.mark.parametrize("plane", ["tcp", "grpc"])
def test_greedy_tokens_match_offline_over_each_data_plane(tiny_qwen3: str, plane: str) -> None:
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512)
    expected = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                          ignore_eos=True))]
    cluster = start_cluster(tiny_qwen3, worker_args=["--kv-data-plane", plane])
    try:
        decode = workers(cluster, "decode")[0]
        with channel(cluster, decode) as ch:   # the reservation names the data plane, or none
            res = worker_pb2_grpc.DecodeWorkerStub(ch).Reserve(worker_pb2.ReserveRequest(
                request_id="probe", prompt_token_ids=PROMPTS[0], params=common_pb2.SamplingParams(max_tokens=2)),
                timeout=10)
            worker_pb2_grpc.WorkerStub(ch).Abort(common_pb2.AbortRequest(request_id="probe"), timeout=10)
        host = decode.rsplit(":", 1)[0]
        assert res.data_address.startswith(f"{host}:") if plane == "tcp" else res.data_address == ""

        async def run():
            async with AsyncClient(cluster.router_address, timeout=60) as client:
                outs = await asyncio.gather(*(client.generate(p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
                                              for p in PROMPTS))
                last = None   # and one aborted while it decodes
                async for msg in client.generate_stream(PROMPTS[1], request_id="to-abort", max_tokens=1500,
                                                        temperature=0.0, ignore_eos=True):
                    if len(msg.token_ids) and last is None:
                        assert await client.abort("to-abort")
                    last = msg
                return outs, last
        outs, last = asyncio.run(run())
        assert [o.token_ids for o in outs] == expected
        assert all(o.timings["kv_streams"] == 1 and o.timings["kv_bytes"] > 0 for o in outs), [o.timings for o in outs]
        assert last.finished and last.finish_reason == "abort"
        assert_blocks_at_baseline(cluster)
    finally:
        cluster.stop()
