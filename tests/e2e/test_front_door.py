"""The router's front doors (OpenAI HTTP and gRPC) under the requests a browser page or a hostile
client sends first, over one real deployment (router + a colocated worker, HTTP on, no API key):
Host and Content-Type checks, work bounded before admission (counts and sizes before tokenizing,
a cap on requests being received), bad values refused by name instead of a 500, and errors that
carry no worker address. The router's CPU is read from /proc, not the wall clock."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import grpc
import pytest

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.deployment.launcher import Cluster, free_port
from tests.conftest import random_prompts
from tests.serving import metric, scrape, start_cluster

PROMPT = random_prompts(1, 12, 12, seed=3)[0]
VOCAB = 1024
ALLOWED = "pdserve.internal"


@dataclass
class Front:
    cluster: Cluster
    port: int
    model: str
    router_pid: int
    log_dir: str

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                content_type: str | None = "application/json") -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            hdrs = {"Content-Type": content_type} if content_type and body is not None else {}
            conn.request(method, path, body, {**hdrs, **(headers or {})})
            resp = conn.getresponse()
            raw = resp.read()
            try:
                return resp.status, json.loads(raw) if raw else {}
            except ValueError:
                return resp.status, {"raw": raw.decode(errors="replace")}
        finally:
            conn.close()

    def post(self, path: str, body: dict | bytes, **kw) -> tuple[int, dict]:
        return self.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode(), **kw)

    def grpc_error(self, request: router_pb2.GenerateRequest) -> grpc.RpcError:
        with grpc.insecure_channel(f"127.0.0.1:{self.cluster.spec.port}",
                                   options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(router_pb2_grpc.RouterStub(ch).Generate(request, timeout=60))
        return err.value


@pytest.fixture(scope="module")
def front(tiny_qwen3: str, tmp_path_factory) -> Front:
    port = free_port()
    log_dir = str(tmp_path_factory.mktemp("front-logs"))
    cluster = start_cluster(tiny_qwen3, colocated_workers=1, log_dir=log_dir, router_args=[
        "--http-port", str(port), "--allowed-hosts", ALLOWED, "--max-pending-requests", "3",
        "--http-body-timeout-s", "4", "--migration-limit", "0"])
    router_pid = next(p.popen.pid for p in cluster.processes if p.name == "router")
    yield Front(cluster, port, os.path.basename(tiny_qwen3), router_pid, log_dir)   # the basename: an alias
    cluster.stop()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _completion(front: Front, **fields) -> dict:
    return {"model": front.model, "prompt": PROMPT, "max_tokens": 2, **fields}


# ---- browsers: Content-Type and Host ------------------------------------------------------------

def test_generation_needs_a_json_content_type(front: Front) -> None:
    body = json.dumps(_completion(front)).encode()
    for content_type in ("text/plain", None, "application/x-www-form-urlencoded"):   # what a page can send unasked
        status, err = front.post("/v1/completions", body, content_type=content_type)
        assert status == 415 and "Content-Type" in err["error"]["message"], (content_type, status, err)
    status, err = front.post("/v1/chat/completions", json.dumps({"model": front.model, "messages": [
        {"role": "user", "content": "hi"}]}).encode(), content_type="text/plain;charset=UTF-8")
    assert status == 415
    status, out = front.post("/v1/completions", body, content_type="application/json; charset=utf-8")
    assert status == 200 and out["usage"]["completion_tokens"] == 2


def test_a_foreign_host_is_refused_without_an_api_key(front: Front) -> None:
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends its own
    name as Host. Refused before anything is read or done; localhost, IP addresses and
    --allowed-hosts are served; /health stays open to probes."""
    evil = {"Host": f"evil.example:{front.port}"}
    for method, path, body in (("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("POST", "/v1/completions", json.dumps(_completion(front)).encode())):
        status, err = front.request(method, path, body, headers=evil)
        assert status == 421 and "Host" in err["error"]["message"] and err["error"]["param"] == "Host", path
    assert front.request("GET", "/health", headers=evil)[0] == 200
    for host in (f"localhost:{front.port}", f"127.0.0.1:{front.port}", "[::1]", f"{ALLOWED}:{front.port}",
                 "PDSERVE.INTERNAL."):
        status, models = front.request("GET", "/v1/models", headers={"Host": host})
        assert status == 200, host
    # root is the served name (which --served-model-name sets), never a path of its own
    assert all(m["root"] == m["id"] for m in models["data"]), models


# ---- work before admission ------------------------------------------------------------------------

def test_two_million_prompts_are_refused_before_any_is_tokenized(front: Front) -> None:
    body = json.dumps({"model": front.model, "prompt": ["a"] * 2_000_000, "max_tokens": 1},
                      separators=(",", ":")).encode()
    assert len(body) < 8 << 20   # under the body cap: the count is what refuses it
    cpu0 = _cpu_seconds(front.router_pid)
    status, err = front.post("/v1/completions", body)
    router_cpu = _cpu_seconds(front.router_pid) - cpu0
    assert status == 400 and err["error"]["param"] == "prompt" and "max_choices" in err["error"]["message"]
    assert router_cpu < 0.8, router_cpu   # reading + parsing 8 MB; 2M tokenizer calls would cost minutes


def test_half_a_million_chat_messages_are_refused_before_rendering(front: Front) -> None:
    body = json.dumps({"model": front.model, "messages": [{"role": "a"}] * 500_000}, separators=(",", ":")).encode()
    cpu0 = _cpu_seconds(front.router_pid)
    status, err = front.post("/v1/chat/completions", body)
    router_cpu = _cpu_seconds(front.router_pid) - cpu0
    assert status == 400 and err["error"]["param"] == "messages" and "max_chat_messages" in err["error"]["message"]
    assert router_cpu < 0.8, router_cpu
    # every string counts, not only content: a huge role, or many names, pass max_prompt_bytes (1 MiB)
    for messages in ([{"role": "r" * (1100 << 10), "content": "hi"}],
                     [{"role": "user", "name": "n" * 600, "content": ""}] * 2000):
        status, err = front.post("/v1/chat/completions", {"model": front.model, "messages": messages})
        assert status == 413 and err["error"]["param"] == "messages" and "max_prompt_bytes" in err["error"]["message"]


def test_a_token_id_prompt_is_measured_before_it_is_copied(front: Front) -> None:
    status, err = front.post("/v1/completions", _completion(front, prompt=[5] * 100_000))
    assert status == 400 and err["error"]["param"] == "prompt" and "max_model_len" in err["error"]["message"]
    err = front.grpc_error(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5] * 4_000_000)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "4000000 tokens" in err.details()


def _slow_body(front: Front) -> socket.socket:
    """A request whose body never finishes arriving: it holds a pending slot."""
    s = socket.create_connection(("127.0.0.1", front.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    return s


def test_requests_being_received_are_capped_over_both_doors(front: Front) -> None:
    """--max-pending-requests 3: three bodies that dribble in hold every slot; the next request,
    HTTP or gRPC, is refused at once (429 / RESOURCE_EXHAUSTED); the slow bodies get 408 after
    --http-body-timeout-s, and the slots come back."""
    held = [_slow_body(front) for _ in range(3)]
    try:
        deadline = time.monotonic() + 30
        while True:   # until the router has seen all three
            status, err = front.post("/v1/completions", _completion(front, max_tokens=1))
            if status == 429:
                break
            assert status == 200 and time.monotonic() < deadline, (status, err)
            time.sleep(0.05)
        assert "max_pending_requests" in err["error"]["message"] and err["error"]["type"] == "rate_limit_error"
        rpc = front.grpc_error(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT)))
        assert rpc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pending_requests" in rpc.details()
        t0 = time.monotonic()
        for s in held:   # the body deadline ends them
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
        assert time.monotonic() - t0 < 20
    finally:
        for s in held:
            s.close()
    status, out = front.post("/v1/completions", _completion(front, max_tokens=1))
    assert status == 200, out


# ---- bad values: refused by name, never a 500 -------------------------------------------------------

def _fd_limits(pid: int) -> tuple[int, int]:
    """A process's open-file limits (soft, hard), from /proc; "unlimited" as 2**63."""
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    soft, hard = (2**63 if v == "unlimited" else int(v) for v in line.split()[3:5])
    return soft, hard


def test_idle_connections_are_capped_and_timed_out(front: Front) -> None:
    """Sockets that connect and send nothing: past the cap they are closed as they are accepted,
    the others once the head timeout passes; meanwhile the router's fds stay bounded and its gRPC
    door serves, and afterwards HTTP serves again."""
    from pdserve.services.api.http_connections import HEAD_TIMEOUT_S, connection_cap
    from pdserve.services.common.fd_limit import raise_fd_limit

    soft, hard = _fd_limits(front.router_pid)
    assert soft >= min(hard, 65535)   # the router raised its soft limit to the hard one at start-up
    cap = connection_cap(soft)         # and its HTTP server took its cap from the raised limit
    if raise_fd_limit() < cap + 300:   # this process opens cap + 100 sockets
        pytest.skip(f"the open-file limit is too low to open {cap + 100} connections")
    fds = lambda: len(os.listdir(f"/proc/{front.router_pid}/fd"))   # noqa: E731
    base = fds()
    started = time.monotonic()   # before the first socket: its head timeout runs from its accept
    socks = [socket.create_connection(("127.0.0.1", front.port), timeout=10) for _ in range(cap + 100)]
    try:
        time.sleep(1.0)   # kept: a window in which the router, offered them all, must hold no more than its cap
        assert fds() <= base + cap + 10
        closed = 0
        for s in socks[-50:]:   # the last ones came past the cap
            s.settimeout(5)
            closed += s.recv(1) == b""
        assert closed == 50
        with grpc.insecure_channel(f"127.0.0.1:{front.cluster.spec.port}") as ch:
            out = list(router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=PROMPT), params=common_pb2.SamplingParams(max_tokens=4)),
                timeout=60))
        assert out and out[-1].finished
        s = socks[0]
        s.settimeout(HEAD_TIMEOUT_S + 20)
        assert s.recv(1) == b""   # closed by the head timeout
        assert time.monotonic() - started >= HEAD_TIMEOUT_S - 1.5
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 20
    while fds() > base + 10:
        assert time.monotonic() < deadline, (fds(), base)
        time.sleep(0.2)
    status, body = front.request("GET", "/v1/models")
    assert status == 200, body


def test_deep_nesting_and_lone_surrogates_are_400s(front: Front) -> None:
    nested = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, err = front.post("/v1/completions", nested)
    assert status == 400 and "nested too deeply" in err["error"]["message"]
    surrogate = json.dumps(_completion(front, prompt="ab\ud800cd")).encode()   # json writes it as \ud800
    assert b"\\ud800" in surrogate
    status, err = front.post("/v1/completions", surrogate)
    assert status == 400 and err["error"]["param"] == "prompt" and "surrogate" in err["error"]["message"]
    status, err = front.post("/v1/chat/completions", {"model": front.model, "messages": [
        {"role": "user", "content": "x\udfff"}]})
    assert status == 400 and err["error"]["param"] == "messages"
    status, err = front.post("/v1/completions", _completion(front, stop=["\ud83d"]))
    assert status == 400 and err["error"]["param"] == "stop"
    status, err = front.post("/v1/completions", _completion(front, model="m\ud800"))   # quoted back in the 404
    assert status == 404 and err["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("fields, param, text", [
    ({"stop": "s" * (1 << 20)}, "stop", "max_stop_bytes"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids", f"[0, {VOCAB})"),
    ({"stop_token_ids": [2**32]}, "stop_token_ids", f"[0, {VOCAB})"),
    ({"max_tokens": 10**12}, "max_tokens", "max_tokens"),
    ({"top_k": 2**31}, "top_k", "top_k"),
], ids=["1MB-stop", "oov-stop-id", "stop-id-2^32", "max_tokens-1e12", "top_k-2^31"])
def test_values_past_their_bounds_are_refused_by_name(front: Front, fields, param, text) -> None:
    status, err = front.post("/v1/completions", _completion(front, **fields))
    assert status == 400 and err["error"]["param"] == param and text in err["error"]["message"], err


@pytest.mark.parametrize("params, text", [
    (common_pb2.SamplingParams(stop_token_ids=[2**32 - 1]), f"[0, {VOCAB})"),
    (common_pb2.SamplingParams(max_tokens=2**32 - 1), "max_tokens"),
    (common_pb2.SamplingParams(top_k=2**31 - 1, max_tokens=2), None),   # the largest int32 is a valid top_k
], ids=["oov-stop-id", "max_tokens", "top_k-int32-max"])
def test_grpc_bounds_name_the_field(front: Front, params, text) -> None:
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT), params=params)
    if text is None:
        with grpc.insecure_channel(f"127.0.0.1:{front.cluster.spec.port}") as ch:
            assert len([m for m in router_pb2_grpc.RouterStub(ch).Generate(request, timeout=60) for _ in m.token_ids]) == 2
        return
    err = front.grpc_error(request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.details(), err.details()


# ---- cache_salt: cached_tokens reveal nothing across salts --------------------------------------------

def test_salted_block_chains_never_meet() -> None:
    from pdserve.engine.kv.block_manager import ROOT_HASH, prompt_block_hashes, salt_root, transfer_block_hashes
    prompt = random_prompts(1, 37, 37, seed=8)[0]
    plain, a, a2, b = (prompt_block_hashes(prompt, 8, root) for root in (
        ROOT_HASH, salt_root("alice"), salt_root("alice"), salt_root("bob")))
    assert a == a2 and salt_root(None) == salt_root("") == ROOT_HASH
    assert not (set(plain) & set(a)) and not (set(a) & set(b)) and len(a) == 4
    assert transfer_block_hashes(prompt, 8, salt_root("alice"))[:4] == a


def test_cache_salt_separates_cached_tokens_over_both_doors(front: Front) -> None:
    prompt = random_prompts(1, 40, 40, seed=21)[0]

    def http_cached(salt: str | None) -> int:
        status, out = front.post("/v1/completions", _completion(front, prompt=prompt, max_tokens=1,
                                                                **({"cache_salt": salt} if salt else {})))
        assert status == 200, out
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    def grpc_cached(salt: str | None) -> int:
        params = common_pb2.SamplingParams(max_tokens=1, **({"cache_salt": salt} if salt else {}))
        with grpc.insecure_channel(f"127.0.0.1:{front.cluster.spec.port}") as ch:
            msgs = list(router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=prompt), params=params), timeout=60))
        return msgs[-1].usage.cached_tokens

    assert http_cached("alice") == 0
    assert http_cached("bob") == 0 and grpc_cached("carol") == 0 and http_cached(None) == 0   # another salt: a miss
    assert http_cached("alice") >= 32 and grpc_cached("bob") >= 32 and grpc_cached(None) >= 32
    status, err = front.post("/v1/completions", _completion(front, cache_salt="s" * 300))
    assert status == 400 and err["error"]["param"] == "cache_salt"


# ---- errors: no worker address, no internal text (last: the worker is killed) ---------------------------

def test_a_failed_request_names_its_id_not_the_worker(front: Front) -> None:
    """--migration-limit 0: the worker killed under an HTTP and a gRPC request fails both; each
    client reads a generic message with its request id, the router's log has the worker's
    address and error."""
    worker = next(p for p in front.cluster.processes if p.name != "router")
    address = worker.address
    results: dict[str, object] = {}

    def http_request() -> None:
        results["http"] = front.post("/v1/completions", _completion(front, max_tokens=1800, ignore_eos=True))

    def grpc_request() -> None:
        results["grpc"] = front.grpc_error(router_pb2.GenerateRequest(
            request_id="doomed-grpc", token_ids=router_pb2.TokenIds(ids=PROMPT),
            params=common_pb2.SamplingParams(max_tokens=1800, ignore_eos=True)))

    threads = [threading.Thread(target=http_request), threading.Thread(target=grpc_request)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while metric(_scrape(front), "pdserve:num_requests_running") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(worker.popen.pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    status, err = results["http"]
    message = err["error"]["message"]
    assert status in (500, 503) and "request id cmpl-" in message, err
    rpc = results["grpc"]
    assert "request id doomed-grpc" in rpc.details(), rpc.details()
    port = address.rsplit(":", 1)[1]
    for text in (message, rpc.details()):
        assert port not in text and "127.0.0.1" not in text, text
    deadline = time.monotonic() + 10
    while port not in _router_log(front):   # the details: in the log, under the request id
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "doomed-grpc" in _router_log(front)


def _scrape(front: Front) -> dict[str, float]:
    return scrape(f"127.0.0.1:{front.port}")   # the HTTP API serves the router's /metrics too


def _router_log(front: Front) -> str:
    with open(os.path.join(front.log_dir, "router.log"), errors="replace") as f:
        return f.read()
