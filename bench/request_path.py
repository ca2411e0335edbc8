"""The modules one request walks through, per process, measured: `pdserve up` (1 prefill + 1
decode) runs with a profiler in every process (a sitecustomize on PYTHONPATH, this script's own);
the modules whose functions run while one streamed HTTP completion is served, less those that also
run in an idle window of the same length (health checks, status streams, metrics), are the
request's path.

    python bench/request_path.py [--model DIR] [--max-tokens 16] [--window-s 3]

Prints each process's modules (serving and shared floors apart from the engine core) and the count
docs/architecture.md quotes."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SITECUSTOMIZE = '''
import os, sys, threading, signal, json
_OUT = os.environ.get("PDSERVE_PATH_TRACE_DIR")
if _OUT:
    _hits = [set()]
    def _profile(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("pdserve."):
                _hits[-1].add(name)
    def _next_window(signum, frame):
        _hits.append(set())
        with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv, "windows": [sorted(h) for h in _hits]}, f)
    signal.signal(signal.SIGUSR2, _next_window)
    sys.setprofile(_profile)
    threading.setprofile(_profile)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return kids + [g for k in kids for g in _children(k)]


def _complete(http_port: int, model: str, max_tokens: int) -> int:
    body = json.dumps({"model": model, "prompt": "The quick brown fox", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return sum(1 for line in resp if line.startswith(b"data: {"))


def _role(argv: list[str]) -> str:
    for role in ("router", "prefill", "decode", "both"):
        if role in argv:
            return role
    return "supervisor"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="what `pdserve up --model` takes (default: tiny, the random-weight "
                    "model the documented counts were measured with)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--window-s", type=float, default=3.0, help="length of the idle and the request windows")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        out = Path(tmp) / "trace"
        out.mkdir()
        env = {**os.environ, "PYTHONPATH": tmp, "PDSERVE_PATH_TRACE_DIR": str(out)}
        port, http_port = _free_port(), _free_port()
        cmd = [sys.executable, "-m", "pdserve", "up", "--model", args.model, "--port", str(port), "--http-port",
               str(http_port)]
        up = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=2).read()
                    break
                except OSError:
                    if up.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"pdserve up did not serve HTTP (exit {up.poll()})")
                    time.sleep(0.5)
            model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models").read())["data"][0]["id"]
            _complete(http_port, model, 2)                  # warm: first-use paths are not the steady path
            pids = [up.pid, *_children(up.pid)]

            def mark() -> None:
                for pid in pids:
                    os.kill(pid, signal.SIGUSR2)
                time.sleep(0.3)
            mark()                                          # window 1: idle
            time.sleep(args.window_s)
            mark()                                          # window 2: one request
            t0 = time.monotonic()
            chunks = _complete(http_port, model, args.max_tokens)
            time.sleep(max(0.0, args.window_s - (time.monotonic() - t0)))
            mark()
        finally:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(60)
        total: set[str] = set()
        for dump in sorted(out.glob("*.json")):
            data = json.loads(dump.read_text())
            idle, busy = set(data["windows"][1]), set(data["windows"][2])
            path = sorted(busy - idle)
            if not path:
                continue
            role = _role(data["argv"])
            services = [m for m in path if not m.startswith("pdserve.engine")]
            engine = [m for m in path if m.startswith("pdserve.engine")]
            print(f"{role} ({len(services)} services modules, {len(engine)} engine modules):")
            print("  services:", ", ".join(m.removeprefix("pdserve.services.") for m in services) or "-")
            print("  engine:  ", ", ".join(m.removeprefix("pdserve.engine.") for m in engine) or "-")
            total |= set(services)
        print(f"streamed chunks: {chunks}")
        print(f"services modules on the request's path, all processes together: {len(total)}")
        print("  " + ", ".join(sorted(m.removeprefix("pdserve.services.") for m in total)))


if __name__ == "__main__":
    main()
