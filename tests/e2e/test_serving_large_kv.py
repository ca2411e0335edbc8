"""A prompt whose KV is larger than 4 MiB crosses the wire intact (multi-frame blocks and streams)."""
from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_maker import make_model
from pdserve.services.client import Client
from tests.conftest import hf_greedy, random_prompts
from tests.serving import metric, scrape, start_cluster


@pytest.fixture(scope="module")
def small_model(model_root) -> str:
    path = model_root / "small-qwen3"
    if not path.exists():
        make_model(path, preset="small", arch="qwen3", seed=0)
    return str(path)


def test_kv_over_4_mib_transfers_exactly(small_model: str) -> None:
    prompt = random_prompts(1, 300, 300, vocab=8192, seed=61)[0]
    # small model in float32: 8 layers x K,V x 4 heads x 64 dims x 4 bytes = 16 KiB per token -> 4.7 MiB
    engine_args = ["--dtype", "float32", "--block-size", "16", "--num-kv-blocks", "64", "--max-num-batched-tokens", "128"]
    offline = LLM(small_model, dtype="float32", block_size=16, num_kv_blocks=64)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    assert expected == hf_greedy(small_model, [prompt], 8)[0]
    cluster = start_cluster(small_model, prefill_workers=1, decode_workers=1, engine_args=engine_args)
    try:
        with Client(cluster.router_address, timeout=60) as client:
            out = client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert out.token_ids == expected
        decode = next(p for p in cluster.processes if p.name.startswith("decode"))
        received = metric(scrape(decode.metrics_address), "pdserve:kv_transfer_bytes_total")
        assert received == 19 * 16 * 16 * 1024 > 4 * 2**20   # 19 blocks of 16 tokens, 16 KiB per token
    finally:
        cluster.stop()
