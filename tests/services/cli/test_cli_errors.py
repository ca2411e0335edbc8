"""Ordinary mistakes get ONE line saying what to do, and the right exit code (2: usage, 1: runtime);
every flag of every command has help and its default; --version; `bench --help`."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.services.cli.commands import build_parser, main
from pdserve.services.deployment.launcher import free_port

ROOT = Path(__file__).resolve().parents[3]


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv) in this process: (exit code, stdout, stderr); argparse's exits included."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv", [["--log-level", "nonsense", "health", "127.0.0.1:1"],
                                  ["health", "127.0.0.1:1", "--log-level", "nonsense"]])
def test_bad_log_level(argv: list[str], capsys) -> None:
    code, _, err = _run(argv, capsys)
    prog = "pdserve" if argv[0] == "--log-level" else "pdserve health"
    assert code == 2
    assert _one_error_line(err) == (f"{prog}: error: argument --log-level: must be one of DEBUG, INFO, WARNING, "
                                    f"ERROR, CRITICAL, got 'nonsense' (see `{prog} --help`)")


def test_bad_log_level_in_the_environment(capsys, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "loud")
    code, _, err = _run(["health", "127.0.0.1:1"], capsys)
    assert code == 2
    assert _one_error_line(err) == ("pdserve: error: $PDSERVE_LOG_LEVEL must be one of DEBUG, INFO, WARNING, "
                                    "ERROR, CRITICAL, got 'loud'")


@pytest.mark.parametrize("command", ["generate", "up", "router", "prefill"])
def test_model_that_does_not_exist(command: str, capsys) -> None:
    argv = [command, "--model", "/nonexistent"] + (["hi"] if command == "generate" else [])
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert _one_error_line(err) == (
        "pdserve: error: --model /nonexistent: no such file or directory; give a local Hugging Face checkpoint "
        "directory, a .gguf file, a Hub id (ORG/NAME), `tiny`, or leave --model out for the default model "
        "(SmolLM2-135M-Instruct)")


@pytest.mark.parametrize("command", ["generate", "up"])
def test_model_that_is_a_hub_id_with_the_hub_unreachable(command: str, capsys, monkeypatch, tmp_path: Path) -> None:
    """A Hub id is downloaded as vLLM does; where the Hub cannot be reached (here: a closed local
    port as its endpoint) the command fails in seconds with one line."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    argv = {"generate": ["generate", "--model", "Qwen/Qwen3-0.6B", "hi"], "up": ["up", "--model", "Qwen/Qwen3-0.6B"]}
    start = time.monotonic()
    code, _, err = _run(argv[command], capsys)
    assert time.monotonic() - start < 20
    assert code == 1
    assert _one_error_line(err) == (
        "pdserve: error: cannot reach the Hugging Face Hub at http://127.0.0.1:9 (ConnectError); download "
        "Qwen/Qwen3-0.6B elsewhere and pass --model DIR, or set HF_ENDPOINT to a mirror")


def test_checkpoint_without_tokenizer(tiny_qwen3: str, tmp_path: Path, capsys) -> None:
    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_qwen3, model)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    code, _, err = _run(["up", "--model", str(model)], capsys)
    assert code == 2
    assert _one_error_line(err) == (f"pdserve: error: --model {model} has no tokenizer (tokenizer.json or "
                                    f"tokenizer_config.json): copy the checkpoint's tokenizer files into it")


def test_directory_that_is_not_a_checkpoint(tmp_path: Path, capsys) -> None:
    code, _, err = _run(["generate", "--model", str(tmp_path), "hi"], capsys)
    assert code == 2
    assert _one_error_line(err) == (f"pdserve: error: --model {tmp_path} is not a Hugging Face checkpoint directory: "
                                    f"it has no config.json (and no .gguf file)")


def test_unreachable_router_is_one_line_and_exit_1() -> None:
    """As a user runs it: a real process, no traceback."""
    address = f"127.0.0.1:{free_port()}"   # nothing listens there
    res = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "generate", "--router", address, "Hello"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 1
    assert res.stdout == ""
    assert _one_error_line(res.stderr) == (
        f"pdserve: error: cannot reach the router at {address} (UNAVAILABLE): is it running? start one with "
        f"`pdserve up`, or pass its address with --router HOST:PORT")


def test_bad_flag_value_is_one_line(capsys) -> None:
    code, _, err = _run(["up", "--port", "x"], capsys)
    assert code == 2
    assert _one_error_line(err) == "pdserve up: error: argument --port: invalid int value: 'x' (see `pdserve up --help`)"


def test_make_model_offers_the_public_presets_and_refuses_a_wrong_arch(tmp_path: Path, capsys) -> None:
    from pdserve.engine.presets import PUBLIC_PRESETS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    preset = next(a for a in sub.choices["make-model"]._actions if a.dest == "preset")
    assert preset.choices == list(PUBLIC_PRESETS) == ["tiny", "small", "qwen3-0.6b", "llama-3.2-1b"]
    code, _, err = _run(["make-model", str(tmp_path / "m"), "--preset", "llama-3.2-1b", "--arch", "qwen3"], capsys)
    assert code == 2 and not (tmp_path / "m").exists()
    assert _one_error_line(err) == \
        "pdserve: error: arch 'qwen3' does not fit preset 'llama-3.2-1b', a llama model's shape"


def test_version(capsys) -> None:
    from importlib.metadata import version
    code, out, _ = _run(["--version"], capsys)
    assert code == 0 and out.strip() == f"pdserve {version('pdserve')}"


def test_bench_help_exits_0_and_lists_the_benchmarks(capsys) -> None:
    code, out, _ = _run(["bench", "--help"], capsys)
    assert code == 0 and "serve" in out and "offline" in out
    code, out, _ = _run(["bench", "serve", "--help"], capsys)
    assert code == 0
    for flag in ("--router", "--num-prompts", "--random-input-len", "--request-rate", "--max-concurrency"):
        assert flag in out
    code, _, err = _run(["bench"], capsys)
    assert code == 2 and _one_error_line(err).startswith("pdserve: error: choose a benchmark")


def _parsers(parser: argparse.ArgumentParser, name: str = "pdserve"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_flag_has_help_and_its_default() -> None:
    missing = []
    for name, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            text = formatter._expand_help(action) if action.help else ""
            if not text or "default" not in text:
                missing.append(f"{name} {action.option_strings[0]}: {text!r}")
    assert not missing, "\n".join(missing)
    assert len(list(_parsers(build_parser()))) >= 12


def test_global_flags_before_or_after_the_subcommand() -> None:
    parser = build_parser()
    for argv in (["--log-level", "debug", "ray", "up"], ["ray", "up", "--log-level", "debug"],
                 ["ray", "--log-level", "debug", "down"], ["up", "--log-level", "info"]):
        assert parser.parse_args(argv).log_level in ("DEBUG", "INFO"), argv


def test_console_script_answers_version_without_loading_torch() -> None:
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "pdserve.services.cli.entry", "--version"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.startswith("pdserve ")
    assert " torch" not in res.stderr   # -X importtime lists every module imported
