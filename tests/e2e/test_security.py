"""The internal plane and the router's API under a hostile neighbour, over real processes:
authentication (cluster token, mutual TLS, API key), bounded sizes, reservation storms,
the admission queue, malformed messages."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.services.client import AsyncClient, Client
from pdserve.services.kv_transfer import GrpcKVSender, KVBlock, KVTransferError
from pdserve.services.api.grpc_router import RETRY_AFTER_KEY
from pdserve.services.common.security import API_KEY_ENV, Credentials, TLSFiles
from pdserve.services.common.proofs import AUTH_HEADER
from tests.certs import make_ca_and_cert
from tests.conftest import hf_greedy, random_prompts
from tests.serving import assert_blocks_at_baseline, channel, metric, scrape, start_cluster, worker_status, workers

PROMPT = random_prompts(1, 30, 30, seed=5)[0]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str):
    c = start_cluster(tiny_qwen3)
    yield c
    c.stop()


def _stranger_calls(cluster, metadata, prompt: list[int]) -> dict[str, grpc.StatusCode]:
    """Every internal RPC, as a caller with the given metadata: name -> status code."""
    prefill, decode = workers(cluster, "prefill")[0], workers(cluster, "decode")[0]
    params = common_pb2.SamplingParams(max_tokens=4)
    calls = {
        "Worker.GetStatus": (decode, lambda ch: worker_pb2_grpc.WorkerStub(ch).GetStatus(
            worker_pb2.StatusRequest(), metadata=metadata, timeout=10)),
        "Worker.WatchStatus": (decode, lambda ch: next(worker_pb2_grpc.WorkerStub(ch).WatchStatus(
            worker_pb2.StatusRequest(), metadata=metadata, timeout=10))),
        "Worker.Abort": (prefill, lambda ch: worker_pb2_grpc.WorkerStub(ch).Abort(
            common_pb2.AbortRequest(request_id="x"), metadata=metadata, timeout=10)),
        "DecodeWorker.Reserve": (decode, lambda ch: worker_pb2_grpc.DecodeWorkerStub(ch).Reserve(
            worker_pb2.ReserveRequest(request_id="poison", prompt_token_ids=prompt, params=params),
            metadata=metadata, timeout=10)),
        "DecodeWorker.Decode": (decode, lambda ch: list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(
            worker_pb2.DecodeRequest(request_id="poison", first_token_id=5), metadata=metadata, timeout=10))),
        "DecodeWorker.DecodeMany": (decode, lambda ch: list(worker_pb2_grpc.DecodeWorkerStub(ch).DecodeMany(
            iter([worker_pb2.DecodeControl(), worker_pb2.DecodeControl(start=worker_pb2.DecodeRequest(
                request_id="poison", first_token_id=5))]), metadata=metadata, timeout=10))),
        "PrefillWorker.Prefill": (prefill, lambda ch: list(worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(
            worker_pb2.PrefillRequest(request_id="p", prompt_token_ids=prompt, params=params),
            metadata=metadata, timeout=10))),
    }
    codes = {}
    for name, (address, call) in calls.items():
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                call(ch)
            codes[name] = err.value.code()
    return codes


def _push_without_credentials(cluster, token: str | None, prompt: list[int]) -> str:
    """KVTransfer.PushBlocks by a stranger: garbage KV with the prompt's public chain hashes. The
    status it gets: the decode worker's UNAUTHENTICATED. grpcio's asyncio client can replace a
    status the server already sent with INTERNAL "Internal error from Core" when one of its
    stream writes was still in flight as the call ended (grpc/grpc#36066; the decode worker ends
    this call at once, before reading it): that is reported as "UNAUTHENTICATED (lost)", and the
    caller's checks of the worker's own state (nothing reserved, nothing kept) still hold it to
    the refusal."""
    decode = workers(cluster, "decode")[0]
    status = worker_status(cluster, decode)
    shape = (status.num_layers, 2, status.block_size, status.num_kv_heads, status.head_dim)
    hashes = transfer_block_hashes(prompt, status.block_size)

    async def run() -> str:
        sender = GrpcKVSender(lambda a: Credentials(token).channel(a))
        stream = sender.open(decode, "poison", b"guessed-token-00")
        await stream.send([KVBlock("poison", i, hashes[i], torch.full(shape, 7.0)) for i in range(len(hashes))])
        try:
            with pytest.raises(KVTransferError) as err:
                await stream.finish(timeout=10)
            if err.value.code == "INTERNAL" and "Internal error from Core" in str(err.value):
                return "UNAUTHENTICATED (lost)"
            return err.value.code
        finally:
            await sender.close()
    return asyncio.run(run())


@pytest.mark.parametrize("token", [None, "x" * 43], ids=["no-token", "wrong-token"])
def test_the_poisoning_sequence_is_refused_and_users_get_correct_tokens(cluster, tiny_qwen3, token) -> None:
    metadata = ((AUTH_HEADER, token),) if token else ()   # a bearer token is no proof
    prompt = random_prompts(1, 30, 30, seed=11 if token else 12)[0]
    codes = _stranger_calls(cluster, metadata, prompt)
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    assert _push_without_credentials(cluster, token, prompt) in ("UNAUTHENTICATED", "UNAUTHENTICATED (lost)")
    assert_blocks_at_baseline(cluster)
    assert worker_status(cluster, workers(cluster, "decode")[0]).num_reserved == 0
    with Client(cluster.router_address, timeout=30) as client:   # the user's request with that prompt
        out = client.generate(prompt, max_tokens=8, **GREEDY)
    assert out.token_ids == hf_greedy(tiny_qwen3, [prompt], 8)[0]
    assert out.usage["cached_tokens"] == 0   # nothing of the stranger's KV was kept


def test_health_stays_open_to_probes(cluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for address in workers(cluster):
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_every_rpc_answers_its_declared_type(cluster) -> None:
    for address in workers(cluster):
        with channel(cluster, address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            assert isinstance(stub.Abort(common_pb2.AbortRequest(request_id="nope"), timeout=10), common_pb2.AbortResponse)
            assert isinstance(stub.GetStatus(worker_pb2.StatusRequest(), timeout=10), worker_pb2.WorkerStatus)
            assert isinstance(next(stub.WatchStatus(worker_pb2.StatusRequest(), timeout=10)), worker_pb2.WorkerStatus)
    with grpc.insecure_channel(cluster.router_address) as ch:
        router = router_pb2_grpc.RouterStub(ch)
        assert router.Abort(common_pb2.AbortRequest(request_id="nope"), timeout=10).found is False
        assert router.GetModelInfo(router_pb2.ModelInfoRequest(), timeout=10).vocab_size == 1024


@pytest.mark.parametrize("build, field", [
    (lambda: router_pb2.GenerateRequest(request_id="r" * 300, text="hi"), "max_request_id_chars"),
    (lambda: router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6]),
                                        params=common_pb2.SamplingParams(stop_token_ids=list(range(1000)))),
     "max_stop_token_ids"),
    (lambda: router_pb2.GenerateRequest(text="x" * (2 << 20)), "max_prompt_bytes"),
])
def test_caller_controlled_sizes_are_refused_by_name(cluster, build, field) -> None:
    with grpc.insecure_channel(cluster.router_address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(router_pb2_grpc.RouterStub(ch).Generate(build(), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("raw, what", [
    (b"\x12\x04\xff\xfe\xfd\xfc", "invalid UTF-8 in the text field"),
    (b"\x0a\xff\xff\xff\xff\x0f", "truncated protobuf"),
])
def test_malformed_requests_get_invalid_argument(cluster, raw, what) -> None:
    with grpc.insecure_channel(cluster.router_address) as ch:
        generate = ch.unary_stream("/pdserve.v1.Router/Generate", request_serializer=lambda b: b,
                                   response_deserializer=router_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(generate(raw, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    assert "malformed request" in err.value.details()


def test_a_malformed_control_on_a_decode_many_stream_gets_invalid_argument(cluster) -> None:
    async def run() -> grpc.aio.AioRpcError:
        async with cluster.spec.credentials.channel(workers(cluster, "decode")[0]) as ch:
            many = ch.stream_stream("/pdserve.v1.DecodeWorker/DecodeMany", request_serializer=lambda b: b,
                                    response_deserializer=worker_pb2.DecodeEvents.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in many(iter([b"", b"\x0a\xff\xff\xff\xff\x0f"]), timeout=10):
                    pass
            return err.value
    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed request" in error.details()


def test_a_tiny_top_p_is_judged_once_by_the_router_with_the_engine_rules(cluster) -> None:
    """top_p=1e-45 becomes 0 as a float32 on the wire: the router refuses it, with the engine's own
    rule, before any worker reserved anything for it."""
    with Client(cluster.router_address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPT, max_tokens=4, temperature=1.0, top_p=1e-45, ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p must be in (0, 1]" in err.value.details()
    assert worker_status(cluster, workers(cluster, "decode")[0]).num_reserved == 0
    assert_blocks_at_baseline(cluster)


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_huge_text_prompt_is_refused_fast_without_memory_growth_or_stalls(cluster) -> None:
    router_pid = next(p.popen.pid for p in cluster.processes if p.name == "router")
    gaps: list[float] = []
    streaming = threading.Event()

    def steady_stream() -> None:   # another user, streaming meanwhile
        with Client(cluster.router_address, timeout=60) as client:
            last = time.monotonic()
            for msg in client.generate_stream(PROMPT, max_tokens=150, **GREEDY):
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                streaming.set()

    other = threading.Thread(target=steady_stream)
    other.start()
    assert streaming.wait(60), "the other user's stream did not start"
    huge = router_pb2.GenerateRequest(text="word " * (12 << 20))
    before = _rss_kb(router_pid)
    cpu_before = _cpu_seconds(router_pid)
    with grpc.insecure_channel(cluster.router_address, options=[("grpc.max_send_message_length", 128 << 20)]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(router_pb2_grpc.RouterStub(ch).Generate(huge, timeout=30))
    # The router's own work, not the wall clock (which also counts this process building and
    # sending 60 MB): refusing by size costs it a few ms; tokenizing 12M words would cost seconds.
    router_cpu = _cpu_seconds(router_pid) - cpu_before
    other.join(60)
    assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
    assert router_cpu < 0.5, router_cpu
    assert _rss_kb(router_pid) - before < 50 * 1024
    assert len(gaps) == 150 and max(gaps[1:]) < 1.0, max(gaps[1:])


# ---- the admission queue ------------------------------------------------------------------------
def test_waiting_requests_cost_nothing_and_a_full_queue_answers_at_once(tiny_qwen3: str) -> None:
    """Decode capacity is held (by reservations the test makes as a member of the plane): requests
    queue at the router without polling anyone; one more than the queue holds is refused at once
    with a retry hint; once capacity returns, every queued request completes exactly."""
    c = start_cluster(tiny_qwen3, engine_args=["--block-size", "8", "--num-kv-blocks", "40", "--dtype", "float32"],
                      worker_args=["--kv-lease-idle-s", "60"], router_args=["--max-queued-requests", "20"])
    try:
        decode = workers(c, "decode")[0]
        held = []
        with channel(c, decode) as ch:   # hold every block the decode worker will give
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            for size in (30, 8, 1):
                while True:
                    try:
                        stub.Reserve(worker_pb2.ReserveRequest(
                            request_id=f"hold-{len(held)}", prompt_token_ids=PROMPT[:size],
                            params=common_pb2.SamplingParams(max_tokens=4)), timeout=10)
                        held.append(f"hold-{len(held)}")
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        break
        prompts = random_prompts(21, 10, 20, seed=9)
        pids = {p.name: p.popen.pid for p in c.processes}
        router_metrics = next(p.metrics_address for p in c.processes if p.name == "router")

        async def scenario():
            async with AsyncClient(c.router_address, timeout=120) as client:
                tasks = [asyncio.create_task(client.generate(p, max_tokens=6, **GREEDY)) for p in prompts]
                deadline = time.monotonic() + 60
                while metric(await asyncio.to_thread(scrape, router_metrics),
                             "pdserve:num_requests_running") < len(prompts):   # all 21 are in: the head and 20 waiting
                    assert time.monotonic() < deadline, "the requests did not all reach the router"
                    await asyncio.sleep(0.05)
                cpu0 = {n: _cpu_seconds(pid) for n, pid in pids.items()}
                await asyncio.sleep(3.0)   # kept: the window whose CPU time is measured
                cpu = {n: _cpu_seconds(pid) - cpu0[n] for n, pid in pids.items()}
                assert cpu["router"] < 0.3 and cpu["decode-0"] < 0.3, cpu   # waiting is free: no retries, no polls
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate(PROMPT, max_tokens=4, **GREEDY)
                assert time.monotonic() - t0 < 5.0   # refused, not queued (queued would wait for capacity)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.value.details()
                assert "max_queued_requests=20, set by --max-queued-requests" in err.value.details()   # what to raise
                retry_ms = dict(err.value.trailing_metadata())[RETRY_AFTER_KEY]
                assert int(retry_ms) >= 1000
                async with c.spec.credentials.channel(decode) as ch:   # capacity comes back: the queue drains
                    for rid in held:
                        await worker_pb2_grpc.WorkerStub(ch).Abort(common_pb2.AbortRequest(request_id=rid), timeout=10)
                return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        results = asyncio.run(scenario())
        expected = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=128).generate(
            prompts, SamplingParams(max_tokens=6, **GREEDY))
        assert [r.token_ids for r in results] == [o.token_ids for o in expected]
        assert_blocks_at_baseline(c)
    finally:
        c.stop()


BURST, BURST_PROMPT, BURST_OUT = 500, 248, 8   # 32 blocks a request: 16 at a time fit the decode worker


def test_a_burst_far_past_decode_capacity_all_completes_by_default(cluster) -> None:
    """What `vllm bench serve` does at its defaults: every request at once, far more than decode
    capacity. By default the router queues them all and serves each in turn: 500 requests, 16 of
    which fit the decode worker at a time (more than 256 waiting: the old bound refused those, and
    the old 60 s queue timeout failed the slow ones), every one completes with all its tokens, and
    every block comes back."""
    prompts = random_prompts(BURST, BURST_PROMPT, BURST_PROMPT, seed=11)
    router_metrics = next(p.metrics_address for p in cluster.processes if p.name == "router")
    peak = 0

    async def scenario():
        nonlocal peak
        async with AsyncClient(cluster.router_address, timeout=600) as client:
            tasks = [asyncio.create_task(client.generate(p, max_tokens=BURST_OUT, **GREEDY)) for p in prompts]
            while not all(t.done() for t in tasks):
                peak = max(peak, metric(await asyncio.to_thread(scrape, router_metrics), "pdserve:num_requests_running"))
                await asyncio.wait(tasks, timeout=0.1)
            return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    assert all(r.finish_reason == "length" and len(r.token_ids) == BURST_OUT for r in results)
    assert peak > 1 + 256 + 16, peak   # in the router at once: past the head, the old bound and those decoding
    assert_blocks_at_baseline(cluster)


def test_a_reservation_storm_is_capped_by_the_lease_and_cannot_starve_a_stream(tiny_qwen3: str) -> None:
    c = start_cluster(tiny_qwen3, engine_args=["--block-size", "8", "--num-kv-blocks", "64", "--dtype", "float32"],
                      worker_args=["--kv-lease-idle-s", "1.5", "--kv-lease-max-s", "4"])
    try:
        decode = workers(c, "decode")[0]
        with Client(c.router_address, timeout=60) as client:
            stream = client.generate_stream(PROMPT, max_tokens=200, **GREEDY)
            tokens = [t for msg in [next(stream), next(stream)] for t in msg.token_ids]
            leases = []
            with channel(c, decode) as ch:   # a member gone rogue: reserve everything, forever if it could
                stub = worker_pb2_grpc.DecodeWorkerStub(ch)
                for i in range(100):
                    try:
                        res = stub.Reserve(worker_pb2.ReserveRequest(
                            request_id=f"storm-{i}", prompt_token_ids=PROMPT, lease_ms=2**32 - 1,
                            params=common_pb2.SamplingParams(max_tokens=4)), timeout=10)
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        break
                    leases.append(res.lease_ms)
            assert leases and max(leases) <= 1500   # the asked-for 49 days are clamped
            tokens += [t for msg in stream for t in msg.token_ids]
        assert tokens == hf_greedy(tiny_qwen3, [PROMPT], 200)[0]   # the stream finished, exactly
        assert_blocks_at_baseline(c, timeout=3.0)                   # and the storm's blocks came back
    finally:
        c.stop()


# ---- credentials ---------------------------------------------------------------------------------
def test_mutual_tls_keeps_out_callers_without_a_deployment_certificate(tiny_qwen3: str, tmp_path) -> None:
    certs = make_ca_and_cert(tmp_path)
    tls = TLSFiles(certs["cert.pem"], certs["key.pem"], certs["ca.pem"])
    c = start_cluster(tiny_qwen3, credentials=Credentials(None, tls))
    try:
        token = c.spec.credentials.cluster_token
        stranger = Credentials(token, TLSFiles(certs["other-cert.pem"], certs["other-key.pem"], certs["ca.pem"]))
        decode = workers(c, "decode")[0]
        for make in (lambda a: grpc.insecure_channel(a),                         # plaintext
                     lambda a: grpc.secure_channel(a, grpc.ssl_channel_credentials(certs["ca.pem"].read_bytes())),
                     stranger.sync_channel):                                    # a certificate of another CA
            with make(decode) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(),
                                                             metadata=Credentials(token).call_proof(
                        "/pdserve.v1.Worker/GetStatus").metadata, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert worker_status(c, decode).num_total_blocks > 0      # the deployment's own certificate: in
        ca = certs["ca.pem"].read_bytes()
        with Client(c.router_address, timeout=30, root_certificates=ca) as client:
            out = client.generate(PROMPT, max_tokens=6, **GREEDY)
        assert out.token_ids == hf_greedy(tiny_qwen3, [PROMPT], 6)[0]
        with Client(c.router_address, timeout=5) as plaintext:
            with pytest.raises(grpc.RpcError):
                plaintext.generate(PROMPT, max_tokens=2, **GREEDY)
    finally:
        c.stop()


def test_the_api_key_is_checked_before_anything_else(tiny_qwen3: str, monkeypatch) -> None:
    key = "k" * 32
    monkeypatch.setenv(API_KEY_ENV, key)   # `pdserve up` hands it to the router through the environment
    c = start_cluster(tiny_qwen3)
    monkeypatch.delenv(API_KEY_ENV)
    try:
        for given in ("", "wrong" * 8):
            with Client(c.router_address, timeout=10, api_key=given) as client:
                with pytest.raises(grpc.RpcError) as err:
                    client.generate([5] * 5000, max_tokens=4)   # invalid too: the key is checked first
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(c.router_address, timeout=30, api_key=key) as client:
            assert len(client.generate(PROMPT, max_tokens=3, **GREEDY).token_ids) == 3
    finally:
        c.stop()
