"""`pdserve certs` end to end: the certificates it makes (through the real CLI) carry a real
deployment with mutual TLS on every channel (router to workers, prefill to decode for KV), a
client with the CA gets its tokens, and a caller without a deployment certificate is refused."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.services.client import Client
from pdserve.services.common.security import Credentials, TLSFiles
from tests.conftest import hf_greedy, random_prompts
from tests.serving import start_cluster, worker_status, workers

PROMPT = random_prompts(1, 20, 20, seed=11)[0]


def _certs(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.services.cli", "certs", *argv], capture_output=True, text=True,
                          timeout=60)


def test_certs_from_the_command_carry_a_mutual_tls_deployment(tiny_qwen3: str, tmp_path) -> None:
    out, other = tmp_path / "certs", tmp_path / "stranger"
    made = _certs("--out", str(out), "--host", "127.0.0.1,localhost", "--days", "2")
    assert made.returncode == 0, made.stderr
    assert "--tls-cert" in made.stdout and "127.0.0.1.pem" in made.stdout
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700
    for name in ("ca.pem", "ca.key", "127.0.0.1.pem", "127.0.0.1.key"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o600, name
    again = _certs("--out", str(out), "--host", "127.0.0.1")   # the key is there: refused without --force
    assert again.returncode == 2 and "--force" in again.stderr, again.stderr
    assert _certs("--out", str(other), "--host", "127.0.0.1").returncode == 0   # another CA: a stranger's

    tls = TLSFiles(out / "127.0.0.1.pem", out / "127.0.0.1.key", out / "ca.pem")
    c = start_cluster(tiny_qwen3, credentials=Credentials(None, tls))
    try:
        with Client(c.router_address, timeout=60, root_certificates=(out / "ca.pem").read_bytes()) as client:
            got = client.generate(PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True)
        assert got.token_ids == hf_greedy(tiny_qwen3, [PROMPT], 5)[0]   # through prefill -> KV -> decode, all mTLS
        token = c.spec.credentials.cluster_token
        decode = workers(c, "decode")[0]
        assert worker_status(c, decode).num_total_blocks > 0      # the deployment's own certificate: in
        no_cert = grpc.ssl_channel_credentials((out / "ca.pem").read_bytes())
        stranger = Credentials(token, TLSFiles(other / "127.0.0.1.pem", other / "127.0.0.1.key", out / "ca.pem"))
        for make in (lambda a: grpc.secure_channel(a, no_cert), stranger.sync_channel, grpc.insecure_channel):
            with make(decode) as ch:
                try:
                    worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10,
                                                             metadata=Credentials(token).call_proof(
                                                                 "/pdserve.v1.Worker/GetStatus").metadata)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                else:
                    raise AssertionError("a caller without a deployment certificate was served")
    finally:
        c.stop()
