"""Prometheus /metrics of every process move by exactly what the traffic implies."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pdserve.services.client import AsyncClient
from tests.conftest import random_prompts
from tests.serving import metric, scrape, start_cluster, worker_status

MAX_TOKENS = 7


async def _generate_all(address: str, prompts: list[list[int]]):
    async with AsyncClient(address, timeout=60) as client:
        return await asyncio.gather(*(client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                                      for p in prompts))


def _by_name(cluster) -> dict[str, str]:
    return {p.name: p.metrics_address for p in cluster.processes}


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return metric(after, name) - metric(before, name)


def _settled(cluster, expect_success: float, before: dict, timeout: float = 20.0) -> dict[str, dict[str, float]]:
    """Scrape every process once the router has counted every request as finished and every KV
    byte a decode worker received is acknowledged to its sender (a prefill worker counts its bytes
    when the acknowledgement arrives, which may come after the request's last token)."""
    deadline = time.monotonic() + timeout
    while True:
        after = {name: scrape(addr) for name, addr in _by_name(cluster).items()}
        kv = "pdserve:kv_transfer_bytes_total"
        sent = sum(_delta(after[n], before[n], kv) for n in after if n.startswith("prefill"))
        received = sum(_delta(after[n], before[n], kv) for n in after if n.startswith("decode"))
        if (_delta(after["router"], before["router"], "pdserve:request_success_total") >= expect_success
                and sent == received):
            return after
        if time.monotonic() > deadline:
            raise AssertionError(f"counters did not settle: KV sent {sent}, received {received}")
        time.sleep(0.05)


def _labelled(samples: dict[str, float], name: str, role: str, worker: str, model: str | None = None) -> float:
    """The series of one process; model_name is the model as the deployment was given it (as vLLM's)."""
    model = model if model is not None else _MODEL[0]
    key = f'{name}{{model_name="{model}",role="{role}",worker="{worker}"}}'
    assert key in samples, (key, [k for k in samples if k.startswith(name)])
    return samples[key]


def _block_bytes(cluster, address: str) -> int:
    s = worker_status(cluster, address)
    itemsize = torch.empty(0, dtype=getattr(torch, s.kv_dtype)).element_size()
    return s.num_layers * 2 * s.block_size * s.num_kv_heads * s.head_dim * itemsize


_MODEL: list[str] = [""]


@pytest.fixture(scope="module")
def cluster_1p1d(tiny_qwen3: str):
    _MODEL[0] = tiny_qwen3
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1)
    yield cluster
    cluster.stop()


def test_counters_disaggregated(cluster_1p1d) -> None:
    prompts = random_prompts(5, 9, 45, seed=901)   # distinct: no prefix-cache hits anywhere
    n, prompt_tokens = len(prompts), sum(len(p) for p in prompts)
    before = {name: scrape(addr) for name, addr in _by_name(cluster_1p1d).items()}
    outs = asyncio.run(_generate_all(cluster_1p1d.router_address, prompts))
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    after = _settled(cluster_1p1d, n, before)
    pre_b, pre_a = before["prefill-0"], after["prefill-0"]
    dec_b, dec_a = before["decode-0"], after["decode-0"]
    rt_b, rt_a = before["router"], after["router"]

    # labels: role and worker on every series
    _labelled(pre_a, "pdserve:prompt_tokens_total", "prefill", "prefill-0")
    _labelled(dec_a, "pdserve:generation_tokens_total", "decode", "decode-0")
    _labelled(dec_a, "pdserve:kv_transfer_bytes_total", "decode", "decode-0")
    _labelled(rt_a, "pdserve:prompt_tokens_total", "router", "router")

    # prompt tokens: the prefill worker prefilled every prompt; the router counts them too; decode none
    assert _delta(pre_a, pre_b, "pdserve:prompt_tokens_total") == prompt_tokens
    assert _delta(rt_a, rt_b, "pdserve:prompt_tokens_total") == prompt_tokens
    assert _delta(dec_a, dec_b, "pdserve:prompt_tokens_total") == 0
    # generation tokens: prefill samples exactly the first token, decode the rest, router streams all
    assert _delta(pre_a, pre_b, "pdserve:generation_tokens_total") == n
    assert _delta(dec_a, dec_b, "pdserve:generation_tokens_total") == n * (MAX_TOKENS - 1)
    assert _delta(rt_a, rt_b, "pdserve:generation_tokens_total") == n * MAX_TOKENS

    # KV bytes: every prompt block, sent once and received once
    decode_addr = next(p.address for p in cluster_1p1d.processes if p.name == "decode-0")
    status = worker_status(cluster_1p1d, decode_addr)
    blocks = sum(-(-len(p) // status.block_size) for p in prompts)
    expected = blocks * _block_bytes(cluster_1p1d, decode_addr)
    sent = _delta(pre_a, pre_b, "pdserve:kv_transfer_bytes_total")
    received = _delta(dec_a, dec_b, "pdserve:kv_transfer_bytes_total")
    assert sent == received == expected
    assert _delta(pre_a, pre_b, "pdserve:kv_transfer_failures_total") == 0
    # one KV send per prompt here (each fits one chunk)
    assert _delta(pre_a, pre_b, "pdserve:kv_transfer_seconds_count") == n

    # prefix cache: both pools looked every prompt token up and found none
    for a, b in ((pre_a, pre_b), (dec_a, dec_b)):
        assert _delta(a, b, "pdserve:prefix_cache_queries_total") == prompt_tokens
        assert _delta(a, b, "pdserve:prefix_cache_hits_total") == 0
        assert _delta(a, b, "pdserve:num_preemptions_total") == 0

    # router request metrics: one TTFT and one e2e observation per request, one ITL per later token
    assert _delta(rt_a, rt_b, "pdserve:request_success_total") == n
    assert _delta(rt_a, rt_b, "pdserve:request_failure_total") == 0
    assert _delta(rt_a, rt_b, "pdserve:time_to_first_token_seconds_count") == n
    assert _delta(rt_a, rt_b, "pdserve:e2e_request_latency_seconds_count") == n
    assert _delta(rt_a, rt_b, "pdserve:inter_token_latency_seconds_count") == n * (MAX_TOKENS - 1)
    assert _delta(pre_a, pre_b, "pdserve:request_queue_time_seconds_count") == n
    assert metric(rt_a, "pdserve:num_requests_running") == 0

    # engine time: decode took at least MAX_TOKENS - 1 steps; the engine thread's CPU time in steps
    # is part of (below) its process's, and every process reports its CPU time
    assert _delta(dec_a, dec_b, "pdserve:engine_step_seconds_count") >= MAX_TOKENS - 1
    for a, b in ((pre_a, pre_b), (dec_a, dec_b)):
        engine_cpu = _delta(a, b, "pdserve:engine_step_cpu_seconds_total")
        assert 0 < engine_cpu < _delta(a, b, "process_cpu_seconds_total") + 0.02
    assert _delta(rt_a, rt_b, "process_cpu_seconds_total") > 0


def test_prefix_hit_moves_cache_counters_and_sends_fewer_bytes(cluster_1p1d) -> None:
    decode_addr = next(p.address for p in cluster_1p1d.processes if p.name == "decode-0")
    bs = worker_status(cluster_1p1d, decode_addr).block_size
    prefix = random_prompts(1, 4 * bs, 4 * bs, seed=902)[0]
    prompts = [prefix + [11, 12, 13], prefix + [21, 22]]
    before = {name: scrape(addr) for name, addr in _by_name(cluster_1p1d).items()}
    for p in prompts:   # one after the other: the second finds the first's blocks
        asyncio.run(_generate_all(cluster_1p1d.router_address, [p]))
    after = _settled(cluster_1p1d, 2, before)
    pre_a, pre_b = after["prefill-0"], before["prefill-0"]
    # the prefill worker counts prompt tokens of every prefilled prompt, cached or not
    assert _delta(pre_a, pre_b, "pdserve:prompt_tokens_total") == sum(map(len, prompts))
    # the decode pool already holds the 4 prefix blocks: only the 5th block of the second prompt moves
    assert _delta(pre_a, pre_b, "pdserve:kv_transfer_bytes_total") == (5 + 1) * _block_bytes(cluster_1p1d, decode_addr)
    assert _delta(after["decode-0"], before["decode-0"], "pdserve:prefix_cache_hits_total") == 4 * bs


def test_counters_colocated(tiny_qwen3: str) -> None:
    _MODEL[0] = tiny_qwen3
    cluster = start_cluster(tiny_qwen3, colocated_workers=1)
    try:
        prompts = random_prompts(4, 9, 45, seed=903)
        n, prompt_tokens = len(prompts), sum(len(p) for p in prompts)
        before = {name: scrape(addr) for name, addr in _by_name(cluster).items()}
        asyncio.run(_generate_all(cluster.router_address, prompts))
        after = _settled(cluster, n, before)
        w_a, w_b = after["both-0"], before["both-0"]
        _labelled(w_a, "pdserve:generation_tokens_total", "both", "both-0")
        assert _delta(w_a, w_b, "pdserve:prompt_tokens_total") == prompt_tokens
        assert _delta(w_a, w_b, "pdserve:generation_tokens_total") == n * MAX_TOKENS
        assert _delta(w_a, w_b, "pdserve:kv_transfer_bytes_total") == 0
        assert _delta(after["router"], before["router"], "pdserve:prompt_tokens_total") == prompt_tokens
        assert _delta(after["router"], before["router"], "pdserve:generation_tokens_total") == n * MAX_TOKENS
    finally:
        cluster.stop()


# ---- the endpoint, the labels, TPOT, and gauges that follow state changes ----------------------
def test_only_metrics_path_answers_and_every_series_names_the_model(cluster_1p1d) -> None:
    import urllib.error
    import urllib.request

    for proc in cluster_1p1d.processes:
        for path in ("/", "/metric", "/metrics/x", "/favicon.ico"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://{proc.metrics_address}{path}", timeout=10)
            assert err.value.code == 404, (proc.name, path)
        samples = scrape(proc.metrics_address)   # /metrics (and /metrics?x=1) answer
        urllib.request.urlopen(f"http://{proc.metrics_address}/metrics?name[]=x", timeout=10).read()
        series = [k for k in samples if k.startswith("pdserve:")]
        assert series and all(f'model_name="{_MODEL[0]}"' in k for k in series), proc.name


def test_router_tpot_histogram(cluster_1p1d) -> None:
    prompts = random_prompts(3, 9, 20, seed=904)
    before = scrape(cluster_1p1d.processes[-1].metrics_address)
    asyncio.run(_generate_all(cluster_1p1d.router_address, prompts))
    after = _settled(cluster_1p1d, len(prompts), {n: scrape(a) for n, a in _by_name(cluster_1p1d).items()}
                     | {"router": before})["router"]
    assert _delta(after, before, "pdserve:time_per_output_token_seconds_count") == len(prompts)
    tpot_sum = _delta(after, before, "pdserve:time_per_output_token_seconds_sum")
    itl_sum = _delta(after, before, "pdserve:inter_token_latency_seconds_sum")
    # each request's TPOT is the mean of its ITL gaps: their sums over requests agree within rounding
    assert tpot_sum == pytest.approx(itl_sum / (MAX_TOKENS - 1), rel=1e-6)


def _wait_gauge(address: str, name: str, value: float, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(scrape(address), name) != value:
        assert time.monotonic() < deadline, f"{name} never became {value} at {address}"
        time.sleep(0.05)


def test_gauges_follow_admission_and_cancel_on_an_idle_engine(cluster_1p1d) -> None:
    """A long request runs on the decode worker (running 1), then its client goes away: the
    worker aborts it and takes no further step, yet the gauge reads 0 (not the last step's 1)."""
    decode = _by_name(cluster_1p1d)["decode-0"]
    prompt = random_prompts(1, 12, 12, seed=905)[0]

    async def run() -> None:
        async with AsyncClient(cluster_1p1d.router_address, timeout=120) as client:
            stream = client.generate_stream(prompt, max_tokens=2000, temperature=0.0, ignore_eos=True)
            await stream.__anext__()          # the first token: the request is on its way to decode
            await asyncio.to_thread(_wait_gauge, decode, "pdserve:num_requests_running", 1.0)
            assert metric(scrape(decode), "pdserve:kv_cache_usage_perc") > 0
            await stream.aclose()             # the client cancels

    asyncio.run(run())
    _wait_gauge(decode, "pdserve:num_requests_running", 0.0)
    _wait_gauge(decode, "pdserve:kv_cache_usage_perc", 0.0)
    _wait_gauge(_by_name(cluster_1p1d)["router"], "pdserve:num_requests_running", 0.0)
