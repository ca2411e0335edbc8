"""`pdserve bench serve`: metric math on synthetic timings, workloads, and a real run against a cluster."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from pdserve.services.loadtest.arrivals import arrival_offsets
from pdserve.services.loadtest.datasets import MIN_TOKEN_ID, DatasetOptions, SampleRequest, length_range, sample_requests
from pdserve.services.loadtest.grpc_backend import send_request
from pdserve.services.loadtest.metrics import calculate_metrics, parse_goodput, percentile_key
from pdserve.services.loadtest.results import RequestResult, Sampling
from pdserve.services.loadtest.serve import build_parser
from pdserve.v1 import router_pb2
from pdserve.services.deployment.launcher import free_port
from tests.serving import start_cluster

REPO = Path(__file__).resolve().parents[2]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _assert_pngs(*paths: Path) -> None:
    """Plots need matplotlib (the `bench` extra); without it bench serve warns and writes none."""
    if not HAVE_MATPLOTLIB:
        assert not any(p.exists() for p in paths)
        pytest.skip("matplotlib is not installed: PNG checks skipped (pip install 'pdserve[bench]')")
    for png in paths:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


# ---------------------------------------------------------------- metric math


def _synthetic() -> list[RequestResult]:
    return [
        # ttft 100 ms, gaps 20/30/50 ms, 4 tokens, e2el 200 ms -> TPOT (200-100)/3 = 33.33 ms
        RequestResult(True, prompt_len=10, output_len=4, ttft=0.100, latency=0.200, itl=[0.020, 0.030, 0.050]),
        # ttft 300 ms, one gap of 10 ms, 2 tokens -> TPOT 10 ms
        RequestResult(True, prompt_len=20, output_len=2, ttft=0.300, latency=0.310, itl=[0.010]),
        # a single output token: no TPOT (counts as 0 for goodput)
        RequestResult(True, prompt_len=30, output_len=1, ttft=0.050, latency=0.050, itl=[]),
        # failed: every number of it must be ignored
        RequestResult(False, prompt_len=40, output_len=7, ttft=9.0, latency=9.0, itl=[5.0], error="UNAVAILABLE: x"),
    ]


def test_metrics_match_vllm_definitions() -> None:
    m = calculate_metrics(_synthetic(), duration=2.0, percentiles=[50, 99, 99.9])
    assert m["completed"] == 3 and m["failed"] == 1 and m["duration"] == 2.0
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(33.5)
    assert m["request_goodput"] is None                       # no --goodput given
    # TTFT over requests: 100, 300, 50 ms
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt((50**2 + 150**2 + 100**2) / 3))   # population std
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.98 * 200)                          # linear interpolation
    assert m["p50_ttft_ms"] == pytest.approx(100.0)
    assert "p99.9_ttft_ms" in m
    # TPOT = (e2el - ttft) / (n - 1), only for n > 1: 33.33 and 10 (not latency / n, not including the 1-token one)
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 10) / 2)
    assert m["median_tpot_ms"] == pytest.approx((100 / 3 + 10) / 2)
    # ITL over all gaps of all requests (20, 30, 50, 10), not a mean of per-request means
    assert m["mean_itl_ms"] == pytest.approx(27.5)
    assert m["median_itl_ms"] == pytest.approx(25.0)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([20, 30, 50, 10], 99))
    # E2E latency over requests: 200, 310, 50 ms
    assert m["mean_e2el_ms"] == pytest.approx(560 / 3)
    assert m["median_e2el_ms"] == pytest.approx(200.0)


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 150.0}, 2),                    # 100 and 50 ms
    ({"ttft": 150.0, "tpot": 20.0}, 1),      # the 33 ms TPOT fails; the 1-token request has TPOT 0
    ({"tpot": 40.0}, 3),
    ({"e2el": 199.0}, 1),
    ({"ttft": 1000.0, "tpot": 1000.0, "e2el": 1000.0}, 3),   # the failed request never counts
])
def test_goodput_counts_requests_meeting_every_slo(slos, good) -> None:
    m = calculate_metrics(_synthetic(), duration=4.0, goodput=slos)
    assert m["request_goodput"] == pytest.approx(good / 4.0)


def test_no_successful_request_gives_zeros_not_errors() -> None:
    m = calculate_metrics([RequestResult(False, error="boom")], duration=1.0, percentiles=[99])
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0 and m["request_throughput"] == 0.0


def test_percentile_key_and_goodput_parsing() -> None:
    assert percentile_key(99) == "p99" and percentile_key(99.0) == "p99" and percentile_key(99.9) == "p99.9"
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    assert parse_goodput(None) is None
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_parser_defaults_follow_vllm() -> None:
    args = build_parser().parse_args([])
    assert args.request_rate == math.inf and args.burstiness == 1.0 and args.num_prompts == 1000
    assert args.percentile_metrics == ["ttft", "tpot", "itl"] and args.metric_percentiles == [99.0]
    assert args.random_input_len == 1024 and args.random_output_len == 128 and args.random_range_ratio == 0.0
    args = build_parser().parse_args(["--sweep", "1,2.5,inf", "--percentile-metrics", "ttft,e2el",
                                      "--metric-percentiles", "50,90,99", "--no-plot"])
    assert args.sweep == [1.0, 2.5, math.inf] and args.percentile_metrics == ["ttft", "e2el"]
    assert args.metric_percentiles == [50.0, 90.0, 99.0] and args.plot is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--request-rate", "0"])


# ---------------------------------------------------------------- client-side timing


class _FakeClient:
    """Streams scripted messages: (delay before it in seconds, token ids, finished)."""

    def __init__(self, script, error: Exception | None = None) -> None:
        self.script, self.error = script, error

    async def generate_stream(self, prompt, **kwargs):
        for delay, ids, finished in self.script:
            await asyncio.sleep(delay)
            msg = router_pb2.GenerateResponse(request_id=kwargs["request_id"], token_ids=ids, finished=finished)
            if finished:
                msg.finish_reason = "length"
            yield msg
        if self.error is not None:
            raise self.error


def _send(client, prompt=(5, 6, 7)) -> RequestResult:
    async def run():
        loop_start = __import__("time").perf_counter()
        return await send_request(client, SampleRequest(list(prompt), len(prompt), 4), "r0", Sampling(), loop_start)
    return asyncio.run(run())


def test_itl_counts_one_gap_per_token_message() -> None:
    # an empty first message (no tokens) must not end TTFT; a 2-token message is ONE gap
    script = [(0.02, [], False), (0.05, [11], False), (0.03, [12, 13], False), (0.03, [], False), (0.04, [14], True)]
    r = _send(_FakeClient(script))
    assert r.success and r.error == "" and r.output_len == 4 and r.finish_reason == "length"
    assert r.ttft >= 0.07
    assert len(r.itl) == 2
    assert r.itl[0] >= 0.03 and r.itl[1] >= 0.07          # the empty message's wait is inside the next gap
    assert r.latency == pytest.approx(r.ttft + sum(r.itl), abs=1e-9)
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 3)
    assert r.prompt_len == 3


def test_rpc_error_is_recorded_as_failure() -> None:
    err = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="worker went away")
    r = _send(_FakeClient([(0.0, [11], False)], error=err))
    assert not r.success and r.error == "UNAVAILABLE: worker went away"
    r = _send(_FakeClient([(0.0, [11], False)]))     # stream ended without a final message
    assert not r.success and "without a finished message" in r.error


def test_arrival_schedule() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    for burstiness in (1.0, 4.0, 0.25):
        t = arrival_offsets(4001, rate=8.0, burstiness=burstiness, seed=3)
        gaps = np.diff(t)
        assert t[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.1)
        # gamma(shape k): coefficient of variation 1/sqrt(k); Poisson (k=1) has CV 1
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)
    assert arrival_offsets(10, 2.0, seed=1) == arrival_offsets(10, 2.0, seed=1)


# ---------------------------------------------------------------- workloads


def test_random_dataset_has_exact_lengths_and_valid_ids() -> None:
    opts = DatasetOptions("random", input_len=100, output_len=20, range_ratio=0.5)
    reqs = sample_requests(opts, 200, vocab_size=1024, seed=7, eos_token_id=0)
    lo, hi = length_range(100, 0.5)
    assert (lo, hi) == (50, 150)
    for r in reqs:
        assert len(r.prompt) == r.prompt_len and lo <= r.prompt_len <= hi and 10 <= r.expected_output_len <= 30
        assert min(r.prompt) >= MIN_TOKEN_ID and max(r.prompt) < 1024
    assert len({r.prompt_len for r in reqs}) > 20
    fixed = sample_requests(DatasetOptions("random", input_len=64, output_len=8), 5, 1024, seed=1)
    assert all(r.prompt_len == 64 and r.expected_output_len == 8 for r in fixed)
    assert [r.prompt for r in fixed] == [r.prompt for r in sample_requests(DatasetOptions("random", input_len=64,
                                                                                          output_len=8), 5, 1024, seed=1)]
    # an EOS id inside the range is never drawn
    assert all(5 not in r.prompt for r in sample_requests(DatasetOptions("random", input_len=500), 20, 8, eos_token_id=5))


def test_shared_prefix_and_mixed_datasets() -> None:
    reqs = sample_requests(DatasetOptions("shared-prefix", input_len=16, output_len=4, prefix_len=64), 6, 1024, seed=2)
    assert all(r.prompt[:64] == reqs[0].prompt[:64] and r.prompt_len == 80 for r in reqs)
    assert len({tuple(r.prompt[64:]) for r in reqs}) == 6
    reqs = sample_requests(DatasetOptions("mixed", output_len=32), 24, 8192, seed=3)
    kinds = [r.kind for r in reqs]
    assert kinds == (["short"] * 7 + ["long"]) * 3
    assert all(r.prompt_len == 1024 and r.expected_output_len == 16 for r in reqs if r.kind == "long")
    assert all(r.prompt_len == 64 and r.expected_output_len == 32 for r in reqs if r.kind == "short")


def test_jsonl_dataset(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "Hello there", "output_len": 5}\n\n{"prompt_token_ids": [5, 6, 7]}\n')
    reqs = sample_requests(DatasetOptions("jsonl", path=str(path), output_len=9), 3, 1024)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in reqs] == [
        ("Hello there", -1, 5), ([5, 6, 7], 3, 9), ("Hello there", -1, 5)]
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="prompt"):
        sample_requests(DatasetOptions("jsonl", path=str(path)), 1, 1024)


# ---------------------------------------------------------------- against a real cluster


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str):
    """1P1D with the router's OpenAI HTTP API too (c.http_url), for --backend openai."""
    http_port = free_port()
    c = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1, router_args=["--http-port", str(http_port)])
    c.http_url = f"http://127.0.0.1:{http_port}"
    yield c
    c.stop()


NUM_PROMPTS, IN_LEN, OUT_LEN = 6, 24, 10


def test_bench_serve_cli_against_cluster(cluster, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pdserve.services.cli", "bench", "serve", "--router", cluster.router_address,
           "--dataset-name", "random", "--random-input-len", str(IN_LEN), "--random-output-len", str(OUT_LEN),
           "--num-prompts", str(NUM_PROMPTS), "--request-rate", "40", "--num-warmups", "1", "--ignore-eos",
           "--goodput", "ttft:60000", "tpot:60000", "--metric-percentiles", "50,99",
           "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "P99 ITL (ms):" in proc.stdout
    # progress on stderr, not a terminal: plain lines up to the last request, no carriage returns
    assert f"rate 40: {NUM_PROMPTS}/{NUM_PROMPTS} requests done (0 failed" in proc.stderr, proc.stderr
    assert "warmup: 1/1 requests done" in proc.stderr and "\r" not in proc.stderr

    res = json.loads((tmp_path / "run.json").read_text())
    assert res["completed"] == NUM_PROMPTS and res["failed"] == 0
    assert res["errors"] == [""] * NUM_PROMPTS and res["finish_reasons"] == ["length"] * NUM_PROMPTS
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput", "request_goodput"):
        assert res[key] > 0, key
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{m}_ms" in res, (stat, m)
    assert res["input_lens"] == [IN_LEN] * NUM_PROMPTS and res["output_lens"] == [OUT_LEN] * NUM_PROMPTS
    assert res["total_input_tokens"] == IN_LEN * NUM_PROMPTS and res["total_output_tokens"] == OUT_LEN * NUM_PROMPTS
    assert res["request_throughput"] == pytest.approx(NUM_PROMPTS / res["duration"])
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])   # generous SLOs: all good
    all_itl = [g for gaps in res["itls"] for g in gaps]
    for ttft, e2el, gaps, n in zip(res["ttfts"], res["e2els"], res["itls"], res["output_lens"]):
        assert 0 < ttft < e2el
        assert len(gaps) == n - 1                                  # one token per message from the router
        assert e2el == pytest.approx(ttft + sum(gaps), abs=1e-6)
        tpot = (e2el - ttft) / (n - 1)
        assert min(gaps) - 1e-9 <= tpot <= max(gaps) + 1e-9
    assert min(all_itl) * 1e3 <= res["mean_tpot_ms"] <= max(all_itl) * 1e3
    assert res["median_ttft_ms"] < res["median_e2el_ms"] and res["p99_ttft_ms"] <= res["p99_e2el_ms"]
    assert res["mean_itl_ms"] == pytest.approx(np.mean(all_itl) * 1e3)
    assert res["mean_ttft_ms"] == pytest.approx(np.mean(res["ttfts"]) * 1e3)
    _assert_pngs(tmp_path / "run_latency_cdf.png", tmp_path / "run_itl_over_time.png")


def test_bench_serve_replays_a_mooncake_trace_with_slo_attainment(cluster, tmp_path: Path) -> None:
    """A Mooncake-format trace scaled 1/32 in tokens, arrivals as written (x0.5): prompts sharing
    block ids share their leading tokens (the server's prefix cache sees them), send times follow
    the trace, and SLO attainment counts every request sent; a sweep rescales to each rate."""
    from pdserve.services.loadtest.serve import main
    rows = [{"timestamp": 400 * i, "input_length": 512 * (2 + i % 3), "output_length": 16,
             "hash_ids": [0, 1 + i % 2, *range(10 + 4 * i, 10 + 4 * i + i % 3)]} for i in range(6)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--router", cluster.router_address, "--dataset-name", "mooncake_trace", "--dataset-path", str(trace),
            "--trace-token-scale", str(1 / 32), "--trace-output-scale", "0.25", "--trace-time-scale", "0.5",
            "--trace-start", "1", "--num-prompts", "5", "--ignore-eos", "--goodput", "ttft:60000", "tpot:60000",
            "--save-result", "--result-dir", str(tmp_path), "--no-plot"]
    assert main([*args, "--result-filename", "trace.json"]) == 0
    res = json.loads((tmp_path / "trace.json").read_text())
    assert res["completed"] == 5 and res["failed"] == 0 and res["dataset_name"] == "mooncake_trace"
    assert res["input_lens"] == [16 * (2 + i % 3) for i in range(1, 6)] and res["output_lens"] == [4] * 5
    assert res["slo_attainment"] == 1.0 and res["request_goodput"] == pytest.approx(res["request_throughput"])
    starts = res["start_times"]
    assert starts[-1] - starts[0] == pytest.approx(0.8, abs=0.3), starts   # 4 gaps of 400 ms x 0.5
    assert all(b - a > 0.05 for a, b in zip(starts, starts[1:])), starts
    # a tight TTFT target: attainment is the share of requests sent that kept it
    assert main([*args, "--result-filename", "tight.json", "--goodput", "ttft:0.001"]) == 0
    assert json.loads((tmp_path / "tight.json").read_text())["slo_attainment"] == 0.0
    assert main([*args, "--result-filename", "sw.json", "--sweep", "5,20"]) == 0
    sweep = json.loads((tmp_path / "sw_sweep.json").read_text())
    assert [r["request_rate"] for r in sweep] == [5.0, 20.0] and all(r["slo_attainment"] == 1.0 for r in sweep)
    assert all(r["completed"] == 5 for r in sweep)


def test_bench_serve_records_failures_and_sweeps(cluster, tmp_path: Path) -> None:
    from pdserve.services.loadtest.serve import main
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt_token_ids": [5] * 2100, "output_len": 4}) + "\n"   # > max_model_len 2048
                    + json.dumps({"prompt_token_ids": [5, 6, 7, 8], "output_len": 3}) + "\n")
    assert main(["--router", cluster.router_address, "--dataset-name", "jsonl", "--dataset-path", str(data),
                 "--num-prompts", "2", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "fail.json", "--no-plot"]) == 0
    res = json.loads((tmp_path / "fail.json").read_text())
    assert res["completed"] == 1 and res["failed"] == 1
    assert res["errors"][0].startswith("INVALID_ARGUMENT") and res["errors"][1] == ""
    assert list(res["error_counts"].values()) == [1] and next(iter(res["error_counts"])).startswith("INVALID_ARGUMENT")
    assert res["output_lens"] == [0, 3] and not list(tmp_path.glob("fail*.png"))

    assert main(["--router", cluster.router_address, "--random-input-len", "8", "--random-output-len", "4",
                 "--num-prompts", "3", "--sweep", "30,inf", "--max-concurrency", "2", "--ignore-eos",
                 "--save-result", "--result-dir", str(tmp_path), "--result-filename", "sw.json"]) == 0
    rows = json.loads((tmp_path / "sw_sweep.json").read_text())
    assert [r["request_rate"] for r in rows] == [30.0, "inf"] and all(r["completed"] == 3 for r in rows)
    assert json.loads((tmp_path / "sw_rateinf.json").read_text())["max_concurrency"] == 2
    _assert_pngs(tmp_path / "sw_sweep.png", tmp_path / "sw_rate30_latency_cdf.png", tmp_path / "sw_rateinf_itl_over_time.png")


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_serve_over_the_openai_http_api(cluster, tiny_qwen3: str, tmp_path: Path, backend: str,
                                              capsys) -> None:
    """The same load generator against pdserve's HTTP API (as against vLLM or SGLang): streaming SSE,
    TTFT and ITL from chunk arrival, every request completed, token counts from the usage chunk."""
    from pdserve.services.loadtest.serve import main
    n, in_len, out_len = 5, 16, 6
    assert main(["--backend", backend, "--base-url", cluster.http_url + "/v1", "--model", tiny_qwen3,
                 "--random-input-len", str(in_len), "--random-output-len", str(out_len), "--num-prompts", str(n),
                 "--request-rate", "50", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "http.json", "--no-plot", "--no-progress"]) == 0
    res = json.loads((tmp_path / "http.json").read_text())
    assert res["backend"] == backend and res["base_url"] == cluster.http_url + "/v1"
    assert res["completed"] == n and res["failed"] == 0 and res["errors"] == [""] * n
    assert res["output_lens"] == [out_len] * n and res["finish_reasons"] == ["length"] * n
    if backend == "openai":       # token-id prompts: exact lengths
        assert res["input_lens"] == [in_len] * n
    else:                         # decoded text in the chat template: the server's count
        assert all(length > 0 for length in res["input_lens"])
    for ttft, e2el, gaps in zip(res["ttfts"], res["e2els"], res["itls"]):
        assert 0 < ttft < e2el and 1 <= len(gaps) <= out_len - 1
        assert e2el >= ttft + sum(gaps) - 1e-6
    # a wrong model name fails every request with the server's 404, recorded, not raised
    assert main(["--backend", backend, "--base-url", cluster.http_url, "--model", "no-such-model",
                 "--tokenizer", tiny_qwen3, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
                 "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bad.json", "--no-plot",
                 "--no-progress"]) == 0
    bad = json.loads((tmp_path / "bad.json").read_text())
    assert bad["completed"] == 0 and all(e.startswith("HTTP 404: The model 'no-such-model' does not exist")
                                         for e in bad["errors"]), bad["errors"]
    (kind, count), = bad["error_counts"].items()   # counted by kind, in the JSON and the report
    assert count == 2 and kind.startswith("HTTP 404: The model 'no-such-model' does not exist")
    assert f"errors: 2 x {kind}" in capsys.readouterr().out.splitlines()
