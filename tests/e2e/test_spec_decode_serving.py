"""Speculative decoding on the decode workers of real deployments (issue 44): the router, a
prefill and decode workers as processes, KV over the raw TCP data plane or over gRPC with
shared memory, or one colocated worker, every worker started with --speculative-config. Greedy output equals the plain
offline output token for token; the decode worker's /metrics and each request's timings carry
the speculative counters; blocks return to baseline; a request whose decode worker is killed
mid-speculation continues on another with exactly the plain tokens."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.client import AsyncClient
from tests.faults.harness import FAULT_ENGINE, FaultCluster, observe, wait_for
from tests.serving import assert_blocks_at_baseline, metric, scrape, start_cluster, workers

# fixed depth: adaptive depth's choice follows measured step times, and these tests count drafts
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "adaptive_depth": False}
SPEC_ARGS = ["--speculative-config", json.dumps(SPEC)]
ENGINE_ARGS = ["--block-size", "8", "--num-kv-blocks", "1024", "--dtype", "float32", "--max-num-batched-tokens", "1024"]
MAX_NEW = 32


def copy_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """A random head, then a pattern repeated to length: drafts from the prompt, and the tiny
    model's outputs, which settle into repeats, accept them."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pattern = [rng.randrange(2, 1000) for _ in range(rng.randint(3, 8))]
        head = [rng.randrange(2, 1000) for _ in range(rng.randint(3, 12))]
        out.append((head + pattern * length)[:max(length, len(head) + 2 * len(pattern))])
    return out


# the shared-memory route carries sends of 1 MiB or more: 1100-token prompts (1 KiB of KV per token)
PROMPTS = {"tcp": copy_prompts(6, 40, seed=44), "shm": copy_prompts(3, 1100, seed=45),
           "colocated": copy_prompts(4, 40, seed=48)}


@pytest.fixture(scope="module")
def reference(tiny_qwen3: str) -> dict[str, list[list[int]]]:
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return {kind: [o.token_ids for o in llm.generate(prompts, params)] for kind, prompts in PROMPTS.items()}


@pytest.fixture(scope="module", params=["tcp", "shm", "colocated"])
def deployment(request: pytest.FixtureRequest, tiny_qwen3: str):
    kind = request.param
    shm_dir = tempfile.mkdtemp(prefix="pdserve-spec-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    worker_args = ["--kv-data-plane", "grpc", "--kv-shared-memory-dir", shm_dir] if kind == "shm" else []
    layout = dict(colocated_workers=1) if kind == "colocated" else dict(prefill_workers=1, decode_workers=1)
    cluster = start_cluster(tiny_qwen3, engine_args=ENGINE_ARGS + SPEC_ARGS, worker_args=worker_args, **layout)
    try:
        yield kind, cluster
    finally:
        cluster.stop()
        left = os.listdir(shm_dir)
        os.rmdir(shm_dir) if not left else None
        assert not left, f"segments outlived the deployment: {left}"


async def _generate_all(address: str, prompts: list[list[int]], **kwargs):
    async with AsyncClient(address, timeout=120) as client:
        return await asyncio.gather(*(client.generate(p, **kwargs) for p in prompts))


def test_served_greedy_speculative_output_is_plain_output(deployment, reference) -> None:
    kind, cluster = deployment
    outs = asyncio.run(_generate_all(cluster.router_address, PROMPTS[kind], max_tokens=MAX_NEW, temperature=0.0,
                                     ignore_eos=True))
    assert [o.token_ids for o in outs] == reference[kind]
    counts = [(o.timings["spec_decode_num_drafts"], o.timings["spec_decode_num_draft_tokens"],
               o.timings["spec_decode_num_accepted_tokens"]) for o in outs]
    assert all(d <= t and a <= t for d, t, a in counts) and sum(a for _, _, a in counts) > 0, counts
    decode = next(p for p in cluster.processes if p.name.startswith(("decode", "both")))
    samples = scrape(decode.metrics_address)
    assert metric(samples, "pdserve:spec_decode_num_drafts_total") == sum(d for d, _, _ in counts)
    assert metric(samples, "pdserve:spec_decode_num_accepted_tokens_total") == sum(a for _, _, a in counts)
    assert metric(samples, "pdserve:spec_decode_num_accepted_tokens_per_pos_total") == sum(a for _, _, a in counts)
    assert samples.get([k for k in samples if k.startswith("pdserve:spec_decode_num_accepted_tokens_per_pos_total")
                        and 'position="0"' in k][0]) > 0
    assert len(workers(cluster)) == (1 if kind == "colocated" else 2)
    assert_blocks_at_baseline(cluster)


MISSED_WINDOWS = 3


@pytest.mark.faults
def test_a_request_whose_decode_worker_dies_mid_speculation_continues_with_the_plain_tokens(tiny_qwen3: str) -> None:
    """1 prefill + 2 decode workers: once the request's decode worker has made 30 tokens (300 or
    more still to make) and verified drafts, it is caught frozen and killed; the router moves the
    request (its tokens so far re-prefilled) to the other, which speculates on; the tokens are the
    plain ones. Accepted drafts make the 600 tokens take a fraction of a second, which a loaded
    machine can let pass before the catch: such a request (its tokens checked too) is sent again,
    up to MISSED_WINDOWS times. The margin is wide because the worker runs between answering the
    catch and being frozen: 80 tokens (about ten steps of accepted drafts) passed there once under
    load, and the request finished before its kill."""
    prompt, max_tokens = copy_prompts(1, 200, seed=46)[0], 600
    want = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=1024).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids
    fc = FaultCluster(tiny_qwen3, prefill=1, decode=2, engine_args=FAULT_ENGINE + SPEC_ARGS)
    try:
        drafted: dict[str, float] = {}

        def has_drafted(name: str) -> bool:   # asked while the worker runs: its metrics answer
            try:
                samples = scrape(fc.process(name).metrics_address)
            except OSError:
                return False
            drafted[name] = metric(samples, "pdserve:spec_decode_num_drafts_total")
            return drafted[name] > 0
        for _ in range(MISSED_WINDOWS + 1):
            obs = observe(fc.router, prompt, max_tokens)
            victim = fc.catch_decoding(obs, len(prompt), max_tokens, done_tokens=30, left_tokens=300, also=has_drafted)
            if victim is not None:
                break
            assert obs.done.wait(60) and obs.code is None and obs.tokens == want, obs
            wait_for(fc.at_baseline, 30, "free blocks at baseline")
        assert victim is not None, f"every request ended before its kill: {obs}"
        drafts = drafted[victim]
        fc.signal(victim, signal.SIGKILL)
        assert obs.done.wait(120), fc.logs()
        assert obs.code is None, (obs.code, obs.details, fc.logs())
        assert drafts > 0 and obs.migrations >= 1 and len(obs.tokens) < max_tokens + 1
        assert obs.tokens == want
        wait_for(fc.all_healthy, 60, "the killed worker restarted")
        wait_for(fc.at_baseline, 30, "free blocks at baseline")
    finally:
        fc.close()
