"""The README's first commands as written: `pdserve up` (the end of command 1; the install before
it is what CI itself runs) serves the default model, the chat command of "Use it" answers the
capital of France with Paris, and the OpenAI-compatible HTTP API answers on port 8000. Only the
gRPC --port is added (50051 may be taken here); no other test binds 8000."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from pdserve.services.common.ports import free_port
from tests.serving import wait_up_line

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_commands() -> tuple[list[str], str]:
    """(the first command's `pdserve up` argv, the shell line of the first `pdserve chat --router`)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    first = next(line for line in blocks[0].splitlines() if line and not line.startswith("#"))
    up = shlex.split(first.rsplit("&&", 1)[1])
    chat = next(line for block in blocks for line in block.splitlines() if "pdserve chat --router" in line)
    return up, chat.split("#", 1)[0].strip()


def test_readme_up_then_chat_answers_paris(default_model: str, user_home: Path) -> None:
    up_argv, chat_line = readme_commands()
    assert up_argv == ["pdserve", "up"], up_argv
    assert "--model" not in chat_line and "What is the capital of France?" in chat_line
    assert (user_home / "models" / Path(default_model).name).is_dir()   # the suite's conversion, linked
    port = free_port()
    env = {**os.environ, "PDSERVE_HOME": str(user_home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    up = subprocess.Popen([*up_argv, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True, env=env)
    try:
        lines = wait_up_line(up)
        chat = subprocess.run(chat_line.replace("127.0.0.1:50051", f"127.0.0.1:{port}"), shell=True, env=env,
                              capture_output=True, text=True, timeout=120)
        assert chat.returncode == 0, chat.stderr[-2000:]
        assert "Paris" in chat.stdout, chat.stdout
        models = json.loads(urllib.request.urlopen("http://127.0.0.1:8000/v1/models", timeout=30).read())
        name = models["data"][0]["id"]
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0, lines.text()
    assert f"router at 127.0.0.1:{port}" in lines.text()
    assert "OpenAI-compatible HTTP API at http://127.0.0.1:8000/v1" in lines.text()
