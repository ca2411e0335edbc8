"""The README's first commands as written: `pdserve up` (the end of command 1; the install before
it is what CI itself runs) serves the default model, and the chat command of "Use it" answers the
capital of France with Paris. Only --port is added (50051 may be taken here)."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
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
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0, lines.text()
    assert f"router at 127.0.0.1:{port}" in lines.text()
