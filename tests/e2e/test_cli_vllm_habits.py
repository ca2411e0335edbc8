"""What a vLLM user does first: `pdserve serve MODEL` (= `pdserve up --model MODEL --http-port`),
the openai client with model=PATH as given, `--served-model-name A B`; and the CLI's first-run
edges: client and help paths without torch, errors pointing to the subcommand's help, a busy port
exit 2 naming the flag."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.services.cli.commands import build_parser
from pdserve.services.common.config_flags import config_from_args, config_to_argv
from pdserve.services.deployment.launcher import free_port
from pdserve.services.router.config import RouterConfig
from tests.services.cli.test_cli_errors import _one_error_line, _run

ROOT = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 240    # the deployment's start on a loaded 2-core machine


# ---------------------------------------------------------------- no torch on client and help paths


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["health", "--help"], ["--version"],
                                  ["up", "--help"], ["serve", "--help"], ["router", "--help"],
                                  ["prefill", "--help"], ["ray", "up", "--help"]])
def test_help_paths_do_not_import_torch(argv: list[str]) -> None:
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "pdserve.services.cli.entry", *argv],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers"}, sorted(imported & {"torch", "transformers"})
    assert "pdserve.services.cli" in imported or argv == ["--version"] or "pdserve.services.cli.entry" in imported


def test_cli_and_client_modules_do_not_import_torch() -> None:
    """Importing the CLI, the clients and the generated parser of a client command loads no engine."""
    code = ("import sys\n"
            "import pdserve.services.cli, pdserve.services.cli.entry, pdserve.services.client, pdserve.services.loadtest.openai_backend\n"
            "from pdserve.services.cli.commands import build_parser, _command_of\n"
            "argv = ['generate', '--router', '127.0.0.1:1', 'hi', '--max-tokens', '3']\n"
            "args = build_parser(_command_of(argv)).parse_args(argv)\n"
            "assert args.router == '127.0.0.1:1' and args.max_tokens == 3\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


# ---------------------------------------------------------------- flag errors and busy ports


@pytest.mark.parametrize("argv, prog", [(["up", "--no-such-flag"], "pdserve up"),
                                        (["generate", "hi", "--no-such-flag"], "pdserve generate"),
                                        (["serve", "--no-such-flag"], "pdserve serve"),
                                        (["ray", "status", "--no-such-flag"], "pdserve ray status")])
def test_unknown_flag_points_to_the_subcommands_help(argv: list[str], prog: str, capsys) -> None:
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert _one_error_line(err) == f"{prog}: error: unrecognized arguments: --no-such-flag (see `{prog} --help`)"


@contextlib.contextmanager
def _listening() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("argv, flag", [(["up", "--port", "{p}"], "--port"),
                                        (["router", "--port", "{p}"], "--port"),
                                        (["up", "--port", "{free}", "--http-port", "{p}"], "--http-port"),
                                        (["serve", "--port", "{p}", "--grpc-port", "{free}"], "--port"),
                                        (["serve", "--port", "{free}", "--grpc-port", "{p}"], "--grpc-port")])
def test_busy_port_is_a_usage_error_naming_the_flag(argv: list[str], flag: str, capsys) -> None:
    # the tiny model, named: the ports are checked before the model is resolved, but should that
    # change, this test must not fetch the default model
    argv = ["serve", "tiny", *argv[1:]] if argv[0] == "serve" else [*argv, "--model", "tiny"]
    with _listening() as port:
        argv = [a.format(p=port, free=free_port()) for a in argv]
        code, out, err = _run(argv, capsys)
    assert code == 2, err
    line = _one_error_line(err)
    assert line.startswith("pdserve: error: ") and f"127.0.0.1:{port} is already in use" in line, line
    assert line.endswith(f"choose another port with {flag} PORT"), line
    assert out == ""


# ---------------------------------------------------------------- served model names, as vLLM's


def test_serve_and_up_are_up_with_the_http_api_on_8000() -> None:
    serve = build_parser().parse_args(["serve", "/m"])
    up = build_parser().parse_args(["up", "--model", "/m"])
    assert serve.func is up.func and serve.model == up.model == "/m"
    assert serve.http_port == up.http_port == 8000 and serve.port is up.port is None
    assert config_from_args(RouterConfig, up).http_port == 8000
    no_http = build_parser().parse_args(["up", "--http-port", "none"])
    assert no_http.http_port is None and config_from_args(RouterConfig, no_http).http_port is None
    assert (serve.prefill_workers, serve.decode_workers, serve.colocated_workers) == (None, None, None)
    serve = build_parser().parse_args(["serve", "/m", "--port", "9000", "--grpc-port", "9001"])
    assert (serve.http_port, serve.port) == (9000, 9001)


def test_served_model_name_takes_several_names() -> None:
    from pdserve.services.api.grpc_router import served_model_names
    args = build_parser().parse_args(["up", "--served-model-name", "a", "org/b", "--http-port", "1"])
    config = config_from_args(RouterConfig, args)
    assert config.served_model_name == ("a", "org/b")
    assert config_to_argv(config) == ["--http-port", "1", "--served-model-name", "a", "org/b"]
    router = build_parser().parse_args(["router", *config_to_argv(config)])    # what `up` hands the router
    assert config_from_args(RouterConfig, router).served_model_name == ("a", "org/b")
    assert served_model_names(config, "/x/ckpt") == ("a", "org/b")
    assert served_model_names(RouterConfig(), "/x/ckpt") == ("ckpt",)
    with pytest.raises(ValueError, match="served_model_name"):
        RouterConfig(served_model_name=("a", " "))


@pytest.fixture(scope="module")
def served(tiny_qwen3: str, tmp_path_factory):
    """`pdserve serve models/tiny` as a user types it, from a directory holding the model."""
    cwd = tmp_path_factory.mktemp("served")
    (cwd / "models").mkdir()
    (cwd / "models" / "tiny").symlink_to(tiny_qwen3)
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve.services.cli.entry", "serve", "models/tiny", "--port", str(http_port),
           "--grpc-port", str(grpc_port), "--dtype", "float32", "--log-dir", str(cwd / "logs"),
           "--kv-cache-memory-bytes", str(64 << 20)]   # the default 1 GiB pool costs seconds of page faults
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not any(line.startswith("try: curl") for line in lines):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(f"pdserve serve exited {proc.returncode}:\n{''.join(lines)}")
            lines.append(line)
            if time.monotonic() > deadline:
                raise AssertionError(f"pdserve serve not up after {UP_TIMEOUT_S}s:\n{''.join(lines)}")
        yield f"http://127.0.0.1:{http_port}", "".join(lines), f"127.0.0.1:{grpc_port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_serve_prints_the_served_name_and_urls(served) -> None:
    base, output, _ = served
    assert f"OpenAI-compatible HTTP API at {base}/v1, model name 'models/tiny'" in output
    assert f"curl {base}/v1/completions" in output and '"model": "models/tiny"' in output


def test_models_lists_the_name_as_given(served) -> None:
    base, _, _ = served
    models = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=30).read())
    assert [m["id"] for m in models["data"]] == ["models/tiny"]


def test_openai_client_with_the_model_path_and_its_basename(served, tiny_qwen3: str) -> None:
    openai = pytest.importorskip("openai")
    base, _, _ = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
    by_path = client.completions.create(model="models/tiny", prompt="Once upon a time", max_tokens=5,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert by_path.model == "models/tiny" and by_path.usage.completion_tokens == 5
    for alias in ("tiny", Path(tiny_qwen3).name):   # the basename as given, and the checkpoint's own
        out = client.completions.create(model=alias, prompt="Once upon a time", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == by_path.choices[0].text
    chat = client.chat.completions.create(model="models/tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="models/other", prompt="x", max_tokens=2)
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"


def test_cli_startup_benchmark_runs(served, tmp_path: Path) -> None:
    """bench/cli_startup.py's paths at one run each (its numbers belong on a quiet machine)."""
    _, _, router = served
    out = tmp_path / "startup.json"
    res = subprocess.run([sys.executable, "bench/cli_startup.py", "--router", router, "--runs", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    numbers = json.loads(out.read_text())
    assert numbers["generate"]["first_output_best_s"] is not None
    for what in ("help", "generate", "unreachable"):
        assert 0 < numbers[what]["best_s"] < 120, what
    assert "pdserve --help" in res.stdout and "nothing there" in res.stdout
