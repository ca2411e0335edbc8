"""A hostile client against real processes (router + 1 prefill + 1 decode, `--slo-admission`, two
named API keys, the OpenAI HTTP API): what issue 41 found, each refused while normal requests keep
their usual latency.

- a request whose own TPOT target no worker keeps (with the most urgent priority) used to become
  the queue's head and stall every request behind it for the whole queue timeout;
- a client choosing its own priority jumped every queue;
- any key holder could abort (or squat) another's request by id;
- errors quoted the whole offending value back (a 1.2 MB logit_bias, a 2 MB tools schema)."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve.services.client import Client
from pdserve.services.deployment.launcher import free_port
from tests.serving import assert_blocks_at_baseline, start_cluster

KEY_A = "a" * 24 + "-key-of-alice"
KEY_B = "b" * 24 + "-key-of-bob"
KEY_OPS = "o" * 24 + "-key-of-ops"
SHORT = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(1, 31))
USUAL_S = 10.0   # a normal request's bound here, under any load CI has; the stall held them 59 s


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# name key grant\nalice {KEY_A}\nbob {KEY_B}\nops {KEY_OPS} min_priority=-10\n")
    keys.chmod(0o600)
    http_port = free_port()
    cluster = start_cluster(tiny_qwen3, engine_args=["--block-size", "8", "--num-kv-blocks", "512", "--dtype",
                                                    "float32"],
                            router_args=["--slo-admission", "--http-port", str(http_port), "--api-keys-file",
                                         str(keys)])
    cluster.http = f"127.0.0.1:{http_port}"
    yield cluster
    cluster.stop()


def _post(cluster, body: dict | bytes, key: str = KEY_A, timeout: float = 60) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{cluster.http}/v1/completions", data,
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _normal_requests(cluster, n: int) -> list[float]:
    """n normal greedy requests at once (alternating keys); each one's latency."""
    took: list[float] = []

    def one(i: int) -> None:
        t0 = time.perf_counter()
        with Client(cluster.router_address, timeout=120, api_key=(KEY_A, KEY_B)[i % 2]) as client:
            assert client.generate([i + 100, *PROMPT], **SHORT).finish_reason == "length"
        took.append(time.perf_counter() - t0)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(took) == n
    return took


def test_an_unkeepable_tpot_target_is_refused_at_arrival_and_stalls_nobody(cluster) -> None:
    with Client(cluster.router_address, timeout=60, api_key=KEY_A) as client:
        client.generate(PROMPT, **SHORT)   # the workers' step costs are known
    alone = _normal_requests(cluster, 10)
    attack = {"model": cluster.spec.model, "prompt": PROMPT, "max_tokens": 4, "slo_tpot_ms": 1e-6,
              "slo_ttft_ms": 3_600_000}
    outcomes: list[tuple[int, bytes]] = []
    grpc_errors: list[grpc.RpcError] = []

    def attacker() -> None:
        outcomes.append(_post(cluster, attack))
        with Client(cluster.router_address, timeout=120, api_key=KEY_B) as client:
            try:
                client.generate(PROMPT, slo_tpot_ms=1e-6, slo_ttft_ms=3_600_000, **SHORT)
            except grpc.RpcError as exc:
                grpc_errors.append(exc)
    t = threading.Thread(target=attacker)
    t.start()
    took = _normal_requests(cluster, 10)
    t.join(120)
    print(f"10 normal requests: slowest {max(alone):.2f}s alone, {max(took):.2f}s beside the attack")
    assert max(took) < USUAL_S, took
    status, body = outcomes[0]
    assert status == 400 and b"slo_tpot_ms" in body, body
    assert grpc_errors and grpc_errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "slo_tpot_ms must be at least" in grpc_errors[0].details()
    # a client's target tighter than a worker keeps but looser than the attack still runs
    with Client(cluster.router_address, timeout=60, api_key=KEY_A) as client:
        assert client.generate(PROMPT, slo_tpot_ms=60_000, **SHORT).finish_reason == "length"
    assert_blocks_at_baseline(cluster)


def test_a_client_may_only_lower_its_own_priority_unless_its_key_grants_more(cluster) -> None:
    with Client(cluster.router_address, timeout=60, api_key=KEY_A) as client:
        for priority in (-1, -1000, -2**31):
            with pytest.raises(grpc.RpcError) as err:
                client.generate(PROMPT, priority=priority, **SHORT)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "priority must be >= 0" in err.value.details() and "alice" in err.value.details()
        assert client.generate(PROMPT, priority=5, **SHORT).finish_reason == "length"
    status, body = _post(cluster, {"model": cluster.spec.model, "prompt": PROMPT, "max_tokens": 2,
                                   "priority": -1000})
    error = json.loads(body)["error"]
    assert status == 403 and error["param"] == "priority" and "must be >= 0" in error["message"]
    with Client(cluster.router_address, timeout=60, api_key=KEY_OPS) as client:
        assert client.generate(PROMPT, priority=-10, **SHORT).finish_reason == "length"
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPT, priority=-11, **SHORT)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and ">= -10" in err.value.details()


def test_request_ids_are_scoped_to_their_api_key(cluster) -> None:
    """bob can neither abort alice's request by its id nor squat the id; alice can abort it."""
    started, ended = threading.Event(), []

    def victim() -> None:
        with Client(cluster.router_address, timeout=120, api_key=KEY_A) as client:
            msgs = []
            for msg in client.generate_stream(PROMPT, request_id="shared-id", max_tokens=2000, temperature=0.0,
                                              ignore_eos=True):
                msgs.append(msg)
                started.set()
            ended.append(msgs[-1].finish_reason)
    t = threading.Thread(target=victim)
    t.start()
    assert started.wait(60)
    with Client(cluster.router_address, timeout=60, api_key=KEY_B) as bob:
        assert bob.abort("shared-id") is False
        # the same id under bob's key is bob's own request, not "already in flight"
        assert bob.generate(PROMPT, request_id="shared-id", **SHORT).finish_reason == "length"
    with Client(cluster.router_address, timeout=60, api_key=KEY_A) as alice:
        assert alice.abort("shared-id") is True
    t.join(120)
    assert ended == ["abort"]
    assert_blocks_at_baseline(cluster)


def test_errors_quote_at_most_a_short_prefix_of_the_value(cluster) -> None:
    big_bias = {str(i): 1.0 for i in range(60_000)}                  # ~1.2 MB of JSON
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"description": "x" * 2_000_000}}}]
    for field, value in (("logit_bias", big_bias), ("tools", tools), ("model", "m" * 100_000)):
        status, body = _post(cluster, {"model": cluster.spec.model, "prompt": PROMPT, "max_tokens": 2, field: value})
        assert 400 <= status < 500 and len(body) < 1024, (field, status, len(body))
        assert field in json.loads(body)["error"]["message"]
    with Client(cluster.router_address, timeout=60, api_key=KEY_A) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPT, max_tokens=4, stop_token_ids=[2**31 - 1] + [1] * 10)
        assert len(err.value.details()) < 600
        assert client.generate(PROMPT, **SHORT).finish_reason == "length"   # the service stayed up
