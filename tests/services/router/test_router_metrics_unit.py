"""The router's /metrics over a pool of workers whose status the test writes (no worker process):
every sample is finite (aiperf and other scrapers drop NaN and infinite ones), and the local-prefill
threshold says off, never local, at any length, or a length in tokens, as its help text documents."""
from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.router.placement import Placement
from pdserve.services.router.router_metrics import THRESHOLD_OFF, RouterMetrics
from pdserve.services.router.worker_pool import WorkerPool
from pdserve.v1 import worker_pb2

THRESHOLD = "pdserve:router_local_prefill_threshold_tokens"
MAX_MODEL_LEN = 2048


@contextlib.contextmanager
def _pool() -> Iterator[WorkerPool]:
    """One prefill and one decode worker, healthy and idle (their channels need a current event loop)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pool = WorkerPool(["127.0.0.1:11"], ["127.0.0.1:21"], [])
    for w in pool.workers:
        w.status = worker_pb2.WorkerStatus(block_size=8, num_total_blocks=256, num_free_blocks=256,
                                           step_base_ms=5.0, step_ms_per_token=0.05, decode_ms_per_seq=0.1,
                                           max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256)
        w.connected = True
    try:
        yield pool
    finally:
        loop.run_until_complete(pool.close())
        asyncio.set_event_loop(None)
        loop.close()


def _samples(pool: WorkerPool, disaggregation: str) -> dict[str, float]:
    """The registry rendered as Prometheus text and parsed back: 'name{labels}' -> value."""
    metrics = RouterMetrics(model_name="m")
    metrics.attach_routing(Placement(pool, "kv-aware", disaggregation))
    metrics.time_to_first_token_seconds.observe(0.01)
    metrics.observe_tpot(1.0, 2.0, 5)
    text = generate_latest(metrics.registry).decode()
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _threshold(samples: dict[str, float]) -> float:
    (value,) = [v for k, v in samples.items() if k.startswith(THRESHOLD)]
    return value


@pytest.mark.parametrize("case", ["always", "idle", "busy", "no prefill worker"])
def test_every_router_sample_is_finite_and_the_threshold_says_its_case(case: str) -> None:
    with _pool() as pool:
        decode = pool.of_role("decode")[0]
        if case == "busy":          # decoding sequences: a long local prefill would stall them
            decode.status.num_running = 16
        if case == "no prefill worker":
            pool.of_role("prefill")[0].connected = False
        samples = _samples(pool, "always" if case == "always" else "conditional")
        not_finite = {k: v for k, v in samples.items() if not math.isfinite(v)}
        assert not not_finite, not_finite
        expected = {"always": THRESHOLD_OFF, "idle": MAX_MODEL_LEN, "no prefill worker": MAX_MODEL_LEN}
        if case in expected:
            assert _threshold(samples) == expected[case]
        else:
            assert 0 <= _threshold(samples) < MAX_MODEL_LEN


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
