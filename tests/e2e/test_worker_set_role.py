"""Worker.SetRole on a real worker process: a prefill worker becomes a decode worker and back in
its running process (one process for every case), and colocated and back: the other roles'
calls answer UNAVAILABLE, the new role's work; a worker with a reservation held refuses
FAILED_PRECONDITION, a role not given INVALID_ARGUMENT."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import Iterator

import grpc
import pytest

from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.services.common.security import Credentials, new_token
from tests.serving import scrape

PROMPT = [(13 * i) % 200 + 3 for i in range(20)]
PARAMS = common_pb2.SamplingParams(temperature=0.0, max_tokens=4)
PREFILL, DECODE, BOTH = worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE, worker_pb2.WORKER_ROLE_BOTH


class WorkerProc:
    """`pdserve prefill` as a child process, its output collected until it exits."""

    def __init__(self, model: str, token: str) -> None:
        env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": token}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "pdserve.services.cli", "prefill", "--model", model, "--port", "0", "--worker-id", "sw",
             "--metrics-port", "0", "--num-kv-blocks", "64", "--block-size", "8", "--dtype", "float32",
             "--threads", "1", "--log-level", "INFO"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.up = threading.Event()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)
            if " listening on " in line:
                self.up.set()
        self.up.set()

    def addresses(self, timeout: float = 120) -> tuple[str, str]:
        """(gRPC address, metrics address) from its "listening on" line."""
        self.up.wait(timeout)
        found = [re.search(r"listening on (\S+), metrics on http://(\S+)/metrics", line) for line in self.lines]
        found = [m for m in found if m]
        assert found, "".join(self.lines)
        return found[0].group(1), found[0].group(2)

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            code = self.popen.wait()
        self.pump.join(10)
        return code


@pytest.fixture(scope="module")
def worker(tiny_qwen3: str) -> Iterator[tuple[WorkerProc, grpc.Channel, str]]:
    """One prefill worker process for the module; a channel that proves the cluster token."""
    token = new_token()
    proc = WorkerProc(tiny_qwen3, token)
    try:
        address, metrics_address = proc.addresses()
        with Credentials(token).sync_channel(address) as ch:
            yield proc, ch, metrics_address
    finally:
        proc.stop()


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def _set_role(ch: grpc.Channel, role: int) -> worker_pb2.WorkerStatus:
    return worker_pb2_grpc.WorkerStub(ch).SetRole(worker_pb2.SetRoleRequest(role=role), timeout=10)


def _reserve(ch: grpc.Channel, rid: str) -> worker_pb2.ReserveResponse:
    return worker_pb2_grpc.DecodeWorkerStub(ch).Reserve(
        worker_pb2.ReserveRequest(request_id=rid, prompt_token_ids=PROMPT, params=PARAMS), timeout=10)


def _prefill(ch: grpc.Channel, rid: str) -> list[worker_pb2.PrefillEvent]:
    """A prefill whose KV no decode worker needs: its first token, then an empty delivery."""
    return list(worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(
        worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=PROMPT, params=PARAMS), timeout=30))


def _generate(ch: grpc.Channel, rid: str, service=worker_pb2_grpc.ColocatedWorkerStub) -> list[int]:
    """A whole generation on one worker (colocated, or a decode worker prefilling locally): its tokens."""
    tokens: list[int] = []
    for event in service(ch).Generate(
            worker_pb2.GenerateLocalRequest(request_id=rid, prompt_token_ids=PROMPT, params=PARAMS), timeout=30):
        if event.HasField("first_token"):
            tokens.append(event.first_token.token_id)
        if event.HasField("decode"):
            tokens.extend(event.decode.token_ids)
    return tokens


def _abort(ch: grpc.Channel, rid: str) -> bool:
    return worker_pb2_grpc.WorkerStub(ch).Abort(common_pb2.AbortRequest(request_id=rid), timeout=10).found


def test_a_prefill_worker_switches_to_decode_and_back_in_its_process(worker) -> None:
    proc, ch, metrics_address = worker
    status = worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10)
    assert status.role == PREFILL and status.num_free_blocks == status.num_total_blocks == 64
    assert any(e.HasField("first_token") for e in _prefill(ch, "before"))
    code, details = _code(lambda: _reserve(ch, "early"))
    assert code is grpc.StatusCode.UNAVAILABLE and "prefill worker now" in details, details

    status = _set_role(ch, DECODE)
    assert status.role == DECODE and status.worker_id == "sw" and status.num_total_blocks == 64
    res = _reserve(ch, "held")   # the decode side was built: the KV data listener named in it
    assert res.num_blocks == 3 and res.data_address.startswith("127.0.0.1:"), res
    code, details = _code(lambda: _prefill(ch, "refused"))
    assert code is grpc.StatusCode.UNAVAILABLE and "decode worker now" in details, details
    samples = scrape(metrics_address)   # gauges moved to the new role label
    assert any(k.startswith("pdserve:num_requests_running{") and 'role="decode"' in k for k in samples)
    assert not any(k.startswith("pdserve:num_requests_running{") and 'role="prefill"' in k for k in samples)

    code, details = _code(lambda: _set_role(ch, PREFILL))   # the reservation is still held
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "1 reserved/receiving KV" in details, details
    assert _set_role(ch, DECODE).role == DECODE            # the same role: the status, nothing else
    assert _abort(ch, "held")

    assert _set_role(ch, PREFILL).role == PREFILL
    events = _prefill(ch, "after")
    assert events[-1].HasField("kv_delivered") and any(e.HasField("first_token") for e in events)
    code, details = _code(lambda: _reserve(ch, "late"))
    assert code is grpc.StatusCode.UNAVAILABLE and "prefill worker now" in details, details
    status = worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10)
    assert status.role == PREFILL and status.num_free_blocks == status.num_total_blocks


def test_a_prefill_worker_turns_colocated_and_back(worker) -> None:
    """Colocated, it generates a whole sequence itself (the same tokens as a decode worker
    prefilling locally), refuses prefill and decode calls; back as prefill, it refuses Generate."""
    _, ch, _ = worker
    code, details = _code(lambda: _generate(ch, "early"))
    assert code is grpc.StatusCode.UNAVAILABLE and "prefill worker now" in details, details
    assert _set_role(ch, BOTH).role == BOTH
    tokens = _generate(ch, "colocated")
    assert len(tokens) == PARAMS.max_tokens, tokens
    for call in (lambda: _prefill(ch, "refused"), lambda: _reserve(ch, "refused")):
        code, details = _code(call)
        assert code is grpc.StatusCode.UNAVAILABLE and "both worker now" in details, details
    assert _set_role(ch, DECODE).role == DECODE
    assert _generate(ch, "local", worker_pb2_grpc.DecodeWorkerStub) == tokens   # greedy: the same tokens
    assert _set_role(ch, PREFILL).role == PREFILL
    code, details = _code(lambda: _generate(ch, "late"))
    assert code is grpc.StatusCode.UNAVAILABLE and "prefill worker now" in details, details
    status = worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10)
    assert status.num_free_blocks == status.num_total_blocks


@pytest.mark.parametrize("role, expected, words", [
    (worker_pb2.WORKER_ROLE_UNSPECIFIED, grpc.StatusCode.INVALID_ARGUMENT, "WORKER_ROLE_UNSPECIFIED"),
    (42, grpc.StatusCode.INVALID_ARGUMENT, "unknown role 42")])
def test_a_role_that_cannot_be_taken_is_refused(worker, role: int, expected: grpc.StatusCode, words: str) -> None:
    _, ch, _ = worker
    code, details = _code(lambda: _set_role(ch, role))
    assert code is expected and words in details, details
    status = worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10)
    assert status.role == PREFILL


def test_each_switch_is_logged_and_the_worker_stops_cleanly(worker) -> None:
    proc, ch, _ = worker
    assert _set_role(ch, DECODE).role == DECODE and _set_role(ch, PREFILL).role == PREFILL
    assert proc.stop() == 0   # SIGTERM: drains (nothing here) and exits
    out = "".join(proc.lines)
    assert "worker sw switched role prefill -> decode" in out, out
    assert "worker sw switched role decode -> prefill" in out, out
    assert "Traceback" not in out, out
