"""bench/vllm_bench_defaults.py: the pure parts (the client's command, the table and ratios from
two saved `vllm bench serve` results, the exit's reasons, flag checks). No vLLM needed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import vllm_bench_defaults as vbd


def _saved(path: Path, **kw) -> Path:
    """A `vllm bench serve --save-result` JSON's keys the table reads."""
    result = {"num_prompts": 200, "request_rate": "inf", "completed": 200, "failed": 0, "duration": 100.0,
              "request_throughput": 2.0, "output_throughput": 256.0, "median_ttft_ms": 40000.0,
              "p99_ttft_ms": 90000.0, "median_tpot_ms": 120.0, **kw}
    path.write_text(json.dumps(result))
    return path


def test_client_runs_vllm_bench_serve_at_its_defaults(tmp_path: Path) -> None:
    argv = vbd.bench_serve_args("http://127.0.0.1:9", "/m/dir", 8, tmp_path, "pdserve")
    assert argv == ["--base-url", "http://127.0.0.1:9", "--model", "/m/dir", "--num-prompts", "8", "--save-result",
                    "--result-dir", str(tmp_path), "--result-filename", "pdserve.json"]
    cmd = vbd.bench_serve_command("/v/bin/python", argv)
    assert cmd[:2] == ["/v/bin/python", "-c"] and cmd[3:] == argv
    assert "vllm.benchmarks.serve import add_cli_args, main" in cmd[2]


def test_table_and_ratios_from_two_saved_results(tmp_path: Path) -> None:
    vl = vbd.read_result(_saved(tmp_path / "vllm.json"))
    pd = vbd.read_result(_saved(tmp_path / "pdserve.json", duration=50.0, request_throughput=4.0,
                                output_throughput=512.0, median_ttft_ms=20000.0, p99_ttft_ms=45000.0,
                                median_tpot_ms=60.0))
    table = vbd.comparison_table(vl, pd, {"vllm": 1.5, "pdserve": 0.25}).splitlines()
    assert table[0] == "| | vLLM | pdserve | pdserve / vLLM |"
    assert "| completed / failed | 200 / 0 | 200 / 0 | |" in table
    assert "| duration (s) | 100.0 | 50.0 | 0.50x |" in table
    assert "| request throughput (req/s) | 2.000 | 4.000 | 2.00x |" in table
    assert "| output throughput (tok/s) | 256.0 | 512.0 | 2.00x |" in table
    assert "| TTFT p50 / p99 (ms) | 40000 / 90000 | 20000 / 45000 | |" in table
    assert "| TPOT p50 (ms) | 120.0 | 60.0 | |" in table
    assert "| 1-min load average before | 1.50 | 0.25 | |" in table


def test_a_missing_side_shows_dashes_and_fails_the_run(tmp_path: Path) -> None:
    pd = vbd.read_result(_saved(tmp_path / "pdserve.json"))
    assert vbd.read_result(tmp_path / "vllm.json") is None
    table = vbd.comparison_table(None, pd, {"pdserve": 0.5})
    assert "| duration (s) | - | 100.0 | - |" in table and "| completed / failed | - | 200 / 0 | |" in table
    assert vbd.problems({"vllm": None, "pdserve": pd}, 200) == ["vllm: no result"]


def test_pdserve_completing_fewer_than_asked_fails_the_run(tmp_path: Path) -> None:
    vl = vbd.read_result(_saved(tmp_path / "vllm.json", completed=150, failed=50))
    assert vbd.problems({"vllm": vl, "pdserve": vbd.read_result(_saved(tmp_path / "pd.json"))}, 200) == []
    short = vbd.read_result(_saved(tmp_path / "pdserve.json", completed=199, failed=1))
    assert vbd.problems({"vllm": vl, "pdserve": short}, 200) == ["pdserve completed 199 of 200 requests"]


def test_client_summary_is_its_result_table_alone() -> None:
    table = "\n".join(["============ Serving Benchmark Result ============", "Successful requests:   8",
                       "---------------Time to First Token----------------", "Median TTFT (ms):   1.0",
                       "=================================================="])
    assert vbd.client_summary(f"Starting main benchmark run...\n{table}\nnanobind: leaked 4 instances!\n") == table
    assert vbd.client_summary("Traceback\nValueError: x") == "Traceback\nValueError: x"


def test_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv(vbd.VLLM_PYTHON_ENV, raising=False)
    args = vbd.build_parser().parse_args(["--pdserve-args", "--disaggregation conditional"])
    assert args.num_prompts == 200 and args.model is None and args.pdserve_args == "--disaggregation conditional"
    with pytest.raises(SystemExit) as exc:
        vbd.main([])
    assert exc.value.code == 2 and "--vllm-python" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vbd.main(["--vllm-python", str(tmp_path / "absent")])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vbd.main(["--vllm-python", __file__, "--num-prompts", "0"])
    assert "at least 1" in capsys.readouterr().err

