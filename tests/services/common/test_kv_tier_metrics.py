"""A worker's /metrics carries its engine's KV tier figures (services/common/metrics.KVTierCollector),
read when scraped, under the worker's labels; nothing without tiers."""
from __future__ import annotations

from prometheus_client import generate_latest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.workers.worker_metrics import KV_TIER_COUNTERS, KV_TIER_GAUGES, WorkerMetrics
from tests.conftest import random_prompts


def samples(metrics: WorkerMetrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("pdserve:kv_") and 'role="both"' in line:
            series, value = line.rsplit(" ", 1)
            out[series.split("{", 1)[0]] = float(value)
    return out


def test_tier_hits_and_holdings_are_published(tiny_qwen3: str, tmp_path) -> None:
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=6, max_num_seqs=4,
              kv_host_cache_bytes=1 << 20, kv_disk_cache_dir=str(tmp_path / "kv"))
    metrics = WorkerMetrics("both", "w0")
    metrics.attach(llm.engine)
    a, b = random_prompts(2, 37, 37, seed=5)
    for prompt in (a, b, a):   # a's blocks are evicted by b's, then come back from a tier
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    got = samples(metrics)
    assert set(got) >= {f"pdserve:{k}_total" for k in KV_TIER_COUNTERS} | {f"pdserve:{k}" for k in KV_TIER_GAUGES}
    assert got["pdserve:kv_offloaded_blocks_total"] > 0 and got["pdserve:kv_host_hits_total"] > 0
    assert got["pdserve:kv_host_blocks"] > 0 and got["pdserve:kv_host_bytes"] > 0


def test_no_tier_figures_without_tiers(tiny_qwen3: str) -> None:
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=16)
    metrics = WorkerMetrics("both", "w0")
    metrics.attach(llm.engine)
    assert not any(k.startswith("pdserve:kv_host") or k.startswith("pdserve:kv_disk") for k in samples(metrics))
