"""`pdserve up` as a user runs it: a real command, health-checked, used, then stopped by SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from services.client import Client
from services.launcher import free_port, wait_serving
from tests.conftest import hf_greedy, random_prompts


def test_up_generate_and_sigterm(tiny_qwen3: str) -> None:
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", tiny_qwen3, "--port", str(port),
           "--prefill-workers", "1", "--decode-workers", "1", "--dtype", "float32",
           "--http-port", str(http_port), "--served-model-name", "tiny"]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_serving(f"127.0.0.1:{port}", up, timeout=120)
        prompt = random_prompts(1, 10, 10, seed=71)[0]
        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            out = client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert out.token_ids == hf_greedy(tiny_qwen3, [prompt], 6)[0]
        cli = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--router", f"127.0.0.1:{port}",
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
    finally:
        up.send_signal(signal.SIGTERM)
        output, _ = up.communicate(timeout=30)
    assert up.returncode == 0, output
    assert f"router at 127.0.0.1:{port}" in output
    assert f"OpenAI-compatible HTTP API at http://127.0.0.1:{http_port}/v1" in output
    for pid in children:   # every child went away with it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"process {pid} outlived `pdserve up`")
