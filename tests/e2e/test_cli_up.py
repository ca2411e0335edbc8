"""`pdserve up` as a user runs it: a real command, health-checked, used, then stopped by SIGTERM."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request

import random
import socket
from pathlib import Path

from pdserve.services.client import Client
from pdserve.services.common.ports import free_port
from tests.conftest import hf_greedy, random_prompts
from tests.serving import scrape, wait_up_line


def _free_port_run(n: int) -> int:
    """A base port B with B..B+n-1 all free on 127.0.0.1, below the kernel's ephemeral range (so
    no port-0 bind of a test running beside this one can take one of them meanwhile)."""
    for _ in range(200):
        base = random.randrange(20000, 32768 - n)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def test_up_generate_and_sigterm(tiny_qwen3: str, user_home: Path) -> None:
    port, http_port, metrics_base = free_port(), free_port(), _free_port_run(3)
    home = user_home
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--model", tiny_qwen3, "--port", str(port),
           "--prefill-workers", "1", "--decode-workers", "1", "--dtype", "float32",
           "--metrics-port-base", str(metrics_base), "--log-level", "info", "--kv-cache-memory-bytes", str(64 << 20),
           "--http-port", str(http_port), "--served-model-name", "tiny"]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                          env={**os.environ, "PDSERVE_HOME": str(home)})
    try:
        lines = wait_up_line(up)   # what a user waits for: the line saying it is up
        # fixed metrics ports: the router on the base, then prefill-0, decode-0
        for offset, role in enumerate(("router", "prefill", "decode")):
            samples = scrape(f"127.0.0.1:{metrics_base + offset}")
            assert any(f'role="{role}"' in k for k in samples if k.startswith("pdserve:")), role
        prompt = random_prompts(1, 10, 10, seed=71)[0]
        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            out = client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert out.token_ids == hf_greedy(tiny_qwen3, [prompt], 6)[0]
        cli = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "generate", "--router", f"127.0.0.1:{port}",
                              "Hello world", "--max-tokens", "5", "--ignore-eos"],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and "finish_reason=length" in cli.stderr and "completion_tokens=5" in cli.stderr
        # the OpenAI-compatible HTTP API, with the flags `up` forwarded to the router
        base = f"http://127.0.0.1:{http_port}"
        models = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=30).read())
        assert [m["id"] for m in models["data"]] == ["tiny"]
        req = urllib.request.Request(f"{base}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True}).encode())
        body = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert body["choices"][0]["text"] == out.text and body["usage"]["completion_tokens"] == 6
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 3   # router, prefill, decode
        for pid in children:        # the global flag reached every child
            assert b"PDSERVE_LOG_LEVEL=INFO\0" in Path(f"/proc/{pid}/environ").read_bytes()
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=30)
    output = lines.text()
    assert up.returncode == 0, output
    assert f"router at 127.0.0.1:{port}" in output
    assert f"OpenAI-compatible HTTP API at http://127.0.0.1:{http_port}/v1" in output
    # what it was doing meanwhile, line by line (not a terminal: no carriage returns)
    log_dir = home / "logs" / f"up-{port}"
    for line in ("pdserve: starting 1 prefill + 1 decode worker(s) and a router", f"logs in {log_dir}",
                 "pdserve: starting 2 worker(s) (loading the model) ...", "pdserve: prefill-0 is up at",
                 "pdserve: decode-0 is up at", "pdserve: starting the router: up"):
        assert line in output, (line, output)
    assert "\r" not in output
    assert {p.name for p in log_dir.iterdir()} == {"prefill-0.log", "decode-0.log", "router.log"}
    assert "listening on" in (log_dir / "router.log").read_text()
    for pid in children:   # every child went away with it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"process {pid} outlived `pdserve up`")
