"""SLO-aware admission over real processes (router + 1 prefill + 1 decode, `--slo-admission`):
refusal by prediction, shedding past the TTFT target, the TPOT guard, and priorities under
overload (services/router/slo.py, services/router/admission.py).

The decode worker's pool is small (290 blocks of 8 tokens). Two long requests (700 prompt + 400
output tokens: 88 blocks reserved for the prompt, growing to 138 while they decode, for a second
or more) leave at most 114 blocks free, so a request with a 1000-token prompt (125 blocks) waits
for capacity at the head of the admission queue, and the ones after it wait behind it."""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve.v1 import membership_pb2 as m
from pdserve.v1 import membership_pb2_grpc, worker_pb2
from pdserve.services.client import Client
from pdserve.services.deployment.launcher import free_port
from tests.serving import metric, scrape, start_cluster, wait_for

LONG = dict(max_tokens=400, temperature=0.0, ignore_eos=True)
SHORT = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(1, 31))
HOLDER = [(i * 7) % 1000 + 1 for i in range(699)]   # a long request's prompt (after its own first token)
BIG = [(i * 11) % 1000 + 1 for i in range(999)]     # a prompt that does not fit beside two long requests
BIG_BLOCKS = 125                                    # its 1000 tokens in blocks of 8


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str):
    http_port = free_port()
    cluster = start_cluster(tiny_qwen3, engine_args=["--block-size", "8", "--num-kv-blocks", "290", "--dtype",
                                                    "float32"],
                            router_args=["--slo-admission", "--http-port", str(http_port)])
    cluster.http = f"127.0.0.1:{http_port}"
    yield cluster
    cluster.stop()


def _router_metrics(cluster) -> dict[str, float]:
    return scrape(next(p.metrics_address for p in cluster.processes if p.name == "router"))


def _decode_free_blocks_seen_by_router(cluster) -> int:
    with cluster.spec.credentials.sync_channel(cluster.router_address) as ch:
        workers = membership_pb2_grpc.MembershipStub(ch).ListWorkers(m.ListWorkersRequest(), timeout=10).workers
    return min(w.num_free_blocks for w in workers if w.role == worker_pb2.WORKER_ROLE_DECODE)


class Occupied:
    """Two long requests holding the decode worker's whole pool, each on its own thread."""

    def __init__(self, cluster) -> None:
        self.cluster, self.results, self.threads = cluster, [], []

    def __enter__(self) -> "Occupied":
        for i in range(2):
            t = threading.Thread(target=self._one, args=(i,))
            t.start()
            self.threads.append(t)
        # Both running at the router, and the router's last status from the decode worker shows
        # their blocks (its prediction reads that status: a request arriving before it came
        # would be predicted to fit at once, and wait instead).
        deadline = time.monotonic() + 30
        while not (metric(_router_metrics(self.cluster), "pdserve:num_requests_running") >= 2
                   and _decode_free_blocks_seen_by_router(self.cluster) < BIG_BLOCKS):
            assert time.monotonic() < deadline, "the long requests did not take the decode worker's pool"
            time.sleep(0.01)
        return self

    def _one(self, i: int) -> None:
        with Client(self.cluster.router_address, timeout=120) as client:
            self.results.append(client.generate([i + 900, *HOLDER], **LONG))

    def __exit__(self, *exc: object) -> None:
        for t in self.threads:
            t.join(120)
        assert len(self.results) == 2 and all(r.finish_reason == "length" for r in self.results)


def test_a_request_predicted_to_miss_its_ttft_target_is_refused_at_once_with_a_retry_hint(cluster) -> None:
    with Client(cluster.router_address, timeout=60) as client:
        client.generate(PROMPT, **SHORT)   # a warm channel: the refusal's time is the router's
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPT, slo_ttft_ms=0.01, **SHORT)
        took = time.perf_counter() - t0
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "would miss its TTFT target" in err.value.details()
        assert any(k == "retry-after-ms" and int(v) >= 100 for k, v in err.value.trailing_metadata())
        assert took < 0.05, f"the refusal took {took * 1e3:.0f} ms"
        assert client.generate(PROMPT, slo_ttft_ms=60_000, **SHORT).finish_reason == "length"
    body = json.dumps({"model": cluster.spec.model, "prompt": PROMPT, "max_tokens": 4, "slo_ttft_ms": 0.01}).encode()
    request = urllib.request.Request(f"http://{cluster.http}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=30)
    assert http_err.value.code == 429 and int(http_err.value.headers["Retry-After"]) >= 1
    assert metric(_router_metrics(cluster), "pdserve:request_slo_rejected_total") >= 2


def test_bad_scheduling_fields_are_refused_naming_the_field(cluster) -> None:
    with Client(cluster.router_address, timeout=60) as client:
        for kwargs, name in ((dict(slo_ttft_ms=-1.0), "slo_ttft_ms"), (dict(slo_tpot_ms=1e12), "slo_tpot_ms"),
                             (dict(user="u" * 300), "user")):
            with pytest.raises(grpc.RpcError) as err:
                client.generate(PROMPT, **SHORT, **kwargs)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
    body = json.dumps({"model": cluster.spec.model, "prompt": PROMPT, "max_tokens": 4, "priority": "high"}).encode()
    request = urllib.request.Request(f"http://{cluster.http}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=30)
    assert http_err.value.code == 400 and "priority" in http_err.value.read().decode()


def test_a_request_that_would_wait_for_decode_capacity_past_its_target_is_refused_at_once(cluster) -> None:
    """The pool is full: the prediction counts the wait until the first long request ends (its
    tokens left at the decode worker's step time), so a target inside it is refused at arrival
    rather than queued to miss it; one beyond it is admitted."""
    with Occupied(cluster), Client(cluster.router_address, timeout=60) as client:
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            client.generate([5, *BIG], slo_ttft_ms=300, **SHORT)
        took = time.perf_counter() - t0
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "would miss its TTFT target" in err.value.details(), err.value.details()
        assert took < 0.05, f"the refusal took {took * 1e3:.0f} ms"
        predicted = float(re.search(r"predicted (\d+) ms", err.value.details()).group(1))
        assert predicted > 300
        assert client.generate([6, *BIG], slo_ttft_ms=600_000, **SHORT).finish_reason == "length"


def test_a_tpot_target_no_decode_step_can_keep_is_refused_at_arrival_naming_the_field(cluster) -> None:
    """Nothing decodes there, but no decode step keeps its TPOT target even alone: no wait would
    place it, so it is refused at once naming slo_tpot_ms and the fastest step (before issue 41 it
    waited at the head of the queue, holding up every request behind it, until shed)."""
    shed_before = metric(_router_metrics(cluster), "pdserve:request_slo_shed_total")
    with Client(cluster.router_address, timeout=60) as client:
        client.generate(PROMPT, **SHORT)   # the decode worker's step cost is known
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPT, slo_ttft_ms=400, slo_tpot_ms=0.001, **SHORT)
        took = time.perf_counter() - t0
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(r"slo_tpot_ms must be at least [\d.]+ ms", err.value.details()), err.value.details()
        assert took < 1.0, f"the refusal took {took * 1e3:.0f} ms"
        assert metric(_router_metrics(cluster), "pdserve:request_slo_shed_total") == shed_before
        assert client.generate(PROMPT, slo_ttft_ms=60_000, slo_tpot_ms=10_000, **SHORT).finish_reason == "length"


def test_a_higher_priority_is_admitted_before_lower_ones_queued_earlier(cluster) -> None:
    first_token: dict[str, float] = {}

    def one(name: str, priority: int) -> None:
        with Client(cluster.router_address, timeout=120) as client:
            for msg in client.generate_stream([len(name), *BIG], priority=priority, **SHORT):
                if msg.token_ids and name not in first_token:
                    first_token[name] = time.perf_counter()
    with Occupied(cluster):
        running = metric(_router_metrics(cluster), "pdserve:num_requests_running")   # the two long ones
        threads = []
        for name, priority in (("low-1", 5), ("low-2", 5), ("low-3", 5), ("high", 0)):
            threads.append(threading.Thread(target=one, args=(name, priority)))
            threads[-1].start()
            wait_for(lambda: metric(_router_metrics(cluster), "pdserve:num_requests_running") >= running + len(threads),
                     30, f"{name} at the router", interval=0.02)   # queued in this order
        for t in threads:
            t.join(120)
    order = sorted(first_token, key=first_token.get)
    assert set(order) == {"low-1", "low-2", "low-3", "high"}
    # low-1 was the head, waiting for capacity, when high arrived: high goes right after it
    assert order.index("high") < order.index("low-2") and order.index("high") < order.index("low-3"), order
