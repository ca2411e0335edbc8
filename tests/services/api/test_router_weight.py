"""The router only tokenizes: its process starts without torch (about 2 s and 150 MB less per
router), also after resolving its model, loading a checkpoint's tokenizer, rendering a chat
template and checking a constraint's text off the grammar library's path (xgrammar, which brings
torch, loads on the first constraint, on a thread). The same holds for Ray's router actor and the
`pdserve ray up` driver, which import the actors' module."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

SCRIPT = """
import sys
import pdserve.services.api.grpc_router, pdserve.services.api.http_server, pdserve.services.api.request_front
from pdserve.engine.checkpoints.resolve import resolve_model
from pdserve.engine.tokenizer import load_tokenizer
tok = load_tokenizer(resolve_model(sys.argv[1]))
ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
assert tok.decode(tok.encode("hello world")) == "hello world"
print("torch" in sys.modules, type(tok).__name__)
"""


def test_a_router_process_imports_no_torch(tiny_qwen3: str) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, tiny_qwen3], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "False", out.stdout


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_the_ray_actors_module_and_a_resolved_model_import_no_torch(tiny_qwen3: str) -> None:
    script = ("import sys\nimport pdserve.services.ray_deploy.actors as a\n"
              "a.model_dir({'model': sys.argv[1]})\nprint('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script, tiny_qwen3], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "False", out.stdout
