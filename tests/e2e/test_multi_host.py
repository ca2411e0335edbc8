"""Across hosts: every pdserve process on its own emulated host (a network namespace joined to the
others by a bridge, services/deployment/netns.py), started through the public CLI with the
cluster token in its environment; greedy tokens exact against the offline engine, KV blocks back
to baseline. The client runs inside the router's host (the test process's own namespace cannot
reach the hosts' addresses, by design)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.deployment import netns
from pdserve.services.common.security import CLUSTER_TOKEN_ENV, new_token
from tests.conftest import random_prompts
from tests.e2e.hosts import INSECURE_FLAG, MAX_NEW, NO_HOSTS, WORKER_PORT, HostDeployment, make_certs

PROMPTS = random_prompts(6, 5, 60, seed=23)

pytestmark = NO_HOSTS


@pytest.fixture(scope="module")
def insecure_args() -> dict[str, list[str]]:
    """Per role, the flag a non-loopback plane without TLS needs."""
    return {role: [INSECURE_FLAG] for role in ("prefill", "decode", "router")}


@pytest.fixture(scope="module", autouse=True)
def no_stale_hosts() -> None:
    """Namespaces a killed earlier run left behind go first."""
    netns.sweep_stale()


@pytest.fixture(scope="module")
def offline_reference(tiny_qwen3: str) -> list[list[int]]:
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def _check(result: dict, want: list[list[int]]) -> None:
    assert result["tokens"] == want
    assert all(total > 0 and free == total for _, free, total in result["blocks"]), result["blocks"]
    assert all(n > 0 for n in result["generated"]), result["generated"]   # every worker took part


@pytest.mark.parametrize("mode, rate_bps", [("plain", None), ("mtls", None), ("plain", 1_000_000_000)],
                         ids=["plain", "mtls", "plain-1gbit"])
def test_router_prefill_decode_on_three_hosts(tiny_qwen3, offline_reference, insecure_args, mode, rate_bps,
                                              tmp_path) -> None:
    with netns.HostNetwork(3, rate_bps) as net:
        if mode == "mtls":
            certs = make_certs(tmp_path, [h.address for h in net.hosts])
            tls = [x for k in ("cert", "key", "ca") for x in (f"--tls-{k}", str(certs[k]))]
            security = {role: tls for role in insecure_args}
        else:
            security = insecure_args
        d = HostDeployment(tiny_qwen3, net, tmp_path, security)
        codec = ["--kv-compression", "off"] if rate_bps else []   # the slow link's lossless case is below
        d.start_router(net[0], [d.worker(net[1], "prefill", *codec)], [d.worker(net[2], "decode")])
        result = d.drive(PROMPTS)
        _check(result, offline_reference)
        if codec:
            assert all(t["kv_codec"] in ("", "off") and t["kv_wire_bytes"] == t["kv_bytes"] for t in result["timings"])


LONG_PROMPT = random_prompts(1, 1200, 1200, seed=29)[0]   # 150 blocks, 1.2 MB of float32 KV
KV_BYTES = r"""
import json, sys, urllib.request
text = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10).read().decode()
out = {}
for line in text.splitlines():
    name = line.split("{", 1)[0]
    if name in ("pdserve:kv_wire_bytes_total", "pdserve:kv_raw_bytes_total"):
        codec = line.split('codec="', 1)[1].split('"', 1)[0]
        out.setdefault(codec, {})["wire" if "wire" in name else "raw"] = float(line.rsplit(" ", 1)[1])
print(json.dumps(out))
"""


@pytest.mark.parametrize("codec", ["lossless"])
def test_kv_compression_over_a_1gbit_link(tiny_qwen3, offline_reference, insecure_args, codec, tmp_path) -> None:
    """--kv-compression on the prefill worker, across the 1 Gbit/s three-host deployment: tokens exact
    (float32 KV: the lossless codec keeps every bit), blocks back to baseline, and the prefill
    worker's /metrics and the router's timings show fewer bytes on the wire than raw."""
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512)
    long_ref = llm.generate([LONG_PROMPT], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    with netns.HostNetwork(3, 1_000_000_000) as net:
        d = HostDeployment(tiny_qwen3, net, tmp_path, insecure_args)
        prefill = d.worker(net[1], "prefill", "--kv-compression", codec)
        d.start_router(net[0], [prefill], [d.worker(net[2], "decode")])
        result = d.drive([*PROMPTS, LONG_PROMPT])
        _check(result, [*offline_reference, long_ref[0].token_ids])
        done = d.client_host.run([sys.executable, "-c", KV_BYTES, d.workers[0][1]], env=d.env, timeout=30,
                                 capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    kv = json.loads(done.stdout.splitlines()[-1])
    assert set(kv) == {codec} and 0 < kv[codec]["wire"] < kv[codec]["raw"], kv
    long = result["timings"][-1]
    assert long["kv_codec"] == codec and long["kv_streams"] == 1, long
    assert 0 < long["kv_wire_bytes"] < long["kv_bytes"], long
    print(f"1200-token prompt over 1 Gbit/s, {codec}: {long['kv_bytes']} raw bytes, {long['kv_wire_bytes']} on the "
          f"wire (ratio {long['kv_bytes'] / long['kv_wire_bytes']:.3f}), kv_transfer_ms {long['kv_transfer_ms']:.1f}; "
          f"prefill /metrics {kv}")


def test_two_prefill_two_decode_on_four_hosts(tiny_qwen3, offline_reference, insecure_args, tmp_path) -> None:
    with netns.HostNetwork(4) as net:
        d = HostDeployment(tiny_qwen3, net, tmp_path, insecure_args)
        prefill = [d.worker(net[0], "prefill"), d.worker(net[1], "prefill")]
        decode = [d.worker(net[2], "decode"), d.worker(net[3], "decode")]
        d.start_router(net[0], prefill, decode)
        _check(d.drive(PROMPTS), offline_reference)


def test_tp2_prefill_feeds_tp1_decode_across_hosts(tiny_qwen3, offline_reference, insecure_args, tmp_path) -> None:
    with netns.HostNetwork(3) as net:
        d = HostDeployment(tiny_qwen3, net, tmp_path, insecure_args)
        prefill = d.worker(net[1], "prefill", "--tensor-parallel-size", "2")
        d.start_router(net[0], [prefill], [d.worker(net[2], "decode")])
        _check(d.drive(PROMPTS), offline_reference)


@pytest.mark.parametrize("argv", [["prefill"], ["router", "--prefill", "{peer}:7100", "--decode", "{peer}:7101"]],
                         ids=["worker", "router"])
def test_a_plane_across_hosts_without_tls_or_the_flag_refuses_to_start(tiny_qwen3, argv, tmp_path) -> None:
    with netns.HostNetwork(2) as net:
        cmd = [sys.executable, "-m", "pdserve.services.cli", *(a.format(peer=net[1].address) for a in argv),
               "--model", tiny_qwen3, "--host", net[0].address, "--port", str(WORKER_PORT)]
        done = net[0].run(cmd, env={**os.environ, CLUSTER_TOKEN_ENV: new_token()}, capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "without mutual TLS" in lines[0] and INSECURE_FLAG in lines[0] and "--tls-cert" in lines[0], lines


def test_tbf_limits_a_raw_tcp_stream() -> None:
    rate = 200_000_000
    with netns.HostNetwork(2, [rate, None]) as net:
        shaped = netns.measure_throughput(net[0], net[1], mib=16)
        assert 0 < shaped * 8 < 1.5 * rate, shaped
        net.set_rate(net[0], None)
        assert netns.measure_throughput(net[0], net[1], mib=16) * 8 > 1.5 * rate   # the limit was tbf's


def test_nothing_of_ours_is_left_behind() -> None:
    with netns.HostNetwork(2) as net:
        names = [net.bridge_ns, *(h.name for h in net.hosts)]
        net[0].popen(["sleep", "600"])
        assert set(names) <= set(netns.namespaces())
    assert not set(names) & set(netns.namespaces())
