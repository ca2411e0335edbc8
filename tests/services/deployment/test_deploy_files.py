"""docker-compose.yml, .env.example, the Prometheus config, Grafana provisioning and dashboard,
the Dockerfiles and .dockerignore: consistent with each other and with the code, checked here
without a Docker daemon. Compose's ${VAR:-default} interpolation is done as compose does it, with
the values of .env.example (which must match the defaults written in the compose file)."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from pdserve.services.cli.commands import build_parser, plane_reach
from pdserve.services.common.security import Credentials, require_secure_internal_plane

ROOT = Path(__file__).resolve().parents[3]
VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def _env_example() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def _interpolate(node, env: dict[str, str]):
    if isinstance(node, str):
        return VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), node.replace("$$", "\0")).replace("\0", "$")
    if isinstance(node, list):
        return [_interpolate(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _interpolate(v, env) for k, v in node.items()}
    return node


def _compose(env: dict[str, str] | None = None) -> dict:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return _interpolate(raw, _env_example() if env is None else env)


def _metrics_ports(compose: dict) -> dict[str, int]:
    ports = {}
    for name, svc in compose["services"].items():
        cmd = svc.get("command") or []
        if "--metrics-port" in cmd:
            ports[name] = int(cmd[cmd.index("--metrics-port") + 1])
    return ports


def test_env_example_documents_every_variable_with_the_compose_default() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = {m.group(1): m.group(2) for m in VAR.finditer(text)}
    example = _env_example()
    assert set(used) <= set(example), f"not in .env.example: {sorted(set(used) - set(example))}"
    for var, default in used.items():
        # empty means "the default" to compose (${VAR:-default}); anything else must be the default
        assert example[var] in ("", default or ""), (var, example[var], default)
    lines = (ROOT / ".env.example").read_text().splitlines()
    for var in example:   # each one is explained by a comment above it (its block)
        i = next(n for n, line in enumerate(lines) if line.startswith(f"{var}="))
        assert any(lines[j].startswith("#") for j in range(max(0, i - 8), i)), var
    assert {"MODEL", "HTTP_PORT", "ROUTER_PORT", "PDSERVE_CLUSTER_TOKEN"} <= set(example)


@pytest.mark.parametrize("model", ["", "/models/my-model"])
def test_compose_commands_parse_with_the_cli(model: str) -> None:
    compose = _compose({**_env_example(), "MODEL": model})
    parser = build_parser()
    services = compose["services"]
    assert {"router", "prefill", "decode", "make-model", "cluster-token", "prometheus", "grafana"} <= set(services)
    for name in ("router", "prefill", "decode"):
        svc = services[name]
        args = parser.parse_args(svc["command"])
        assert args.command == name
        assert args.model == (model or "/models/tiny-qwen3")
        assert args.cluster_token_file == "/run/pdserve/cluster_token"   # the secret as a file, never argv
        assert svc["healthcheck"]["test"][:2] == ["CMD", "pdserve"]
        assert parser.parse_args(svc["healthcheck"]["test"][2:]).command == "health"
        assert svc["depends_on"], name
    router = parser.parse_args(services["router"]["command"])
    assert router.prefill == "prefill:50052" and router.decode == "decode:50053"


def test_compose_commands_pass_the_internal_plane_rule() -> None:
    """Each service would start: the rule the CLI applies (services.common.security), on what its command
    binds and dials; without the flag the same commands are refused (compose has no TLS)."""
    services = _compose()["services"]
    parser = build_parser()
    for name in ("router", "prefill", "decode"):
        args = parser.parse_args(services[name]["command"])
        binds, dials = plane_reach(args)
        assert binds or dials, name
        require_secure_internal_plane(Credentials("t" * 32), name, binds=binds, dials=dials,
                                      insecure_plane=args.insecure_internal_plane)
        with pytest.raises(ValueError, match="--insecure-internal-plane"):
            require_secure_internal_plane(Credentials("t" * 32), name, binds=binds, dials=dials)


def test_nothing_secret_in_any_command_and_ports_on_loopback() -> None:
    compose = _compose({**_env_example(), "PDSERVE_CLUSTER_TOKEN": "s3cret-s3cret-s3cret", "GRAFANA_ADMIN_PASSWORD": "pw"})
    for name, svc in compose["services"].items():
        argv = " ".join(map(str, (svc.get("command") or []) + (svc.get("entrypoint") or [])))
        assert "s3cret" not in argv and "--api-key " not in argv and "PDSERVE_CLUSTER_TOKEN=" not in argv, name
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    published = {p.split(":")[-1] for svc in compose["services"].values() for p in svc.get("ports", [])}
    assert {"50051", "8000", "9090", "3000"} <= published
    assert compose["services"]["cluster-token"]["environment"]["PDSERVE_CLUSTER_TOKEN"] == "s3cret-s3cret-s3cret"


def test_model_maker_runs_only_without_a_model() -> None:
    svc = _compose()["services"]["make-model"]
    assert svc["entrypoint"][:2] == ["sh", "-c"] and svc["restart"] == "no"
    script = svc["entrypoint"][2]
    assert script.startswith('if [ -n "$MODEL" ]; then') and "nothing to make" in script
    make = shlex.split(script.split("exec ", 1)[1].split(";")[0])
    assert make[0] == "pdserve" and build_parser().parse_args(make[1:]).command == "make-model"
    assert svc["environment"]["MODEL"] == ""


def test_prometheus_scrapes_every_process_on_its_port() -> None:
    compose = _compose()
    ports = _metrics_ports(compose)
    assert set(ports) == {"router", "prefill", "decode"}
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert sorted(targets) == sorted(f"{name}:{port}" for name, port in ports.items())
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
    prom = compose["services"]["prometheus"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]


def _registered_metric_names() -> set[str]:
    """Every sample name the processes export (with _bucket/_sum/_count/_total)."""
    from pdserve.services.router.router_metrics import RouterMetrics
    from pdserve.services.workers.worker_metrics import WorkerMetrics
    names = set()
    for m in (WorkerMetrics("prefill", "w"), RouterMetrics()):
        for family in m.registry.collect():
            for sample in family.samples:
                names.add(sample.name)
            names.add(family.name)
    return names


def test_grafana_provisioning_and_dashboard_use_existing_metrics() -> None:
    compose = _compose()
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")}
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert ds[0]["type"] == "prometheus" and ds[0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/pdserve.yml").read_text())["providers"][0]
    dash_dir = provider["options"]["path"]
    assert mounts[dash_dir] == "./deploy/grafana/dashboards" and mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/pdserve.json").read_text())
    known = _registered_metric_names()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    used = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == ds[0]["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"pdserve:[a-z0-9_]+", target["expr"]):
                assert name in known, f"{panel['title']}: {name} is not exported (services/common/metrics.py)"
                used.add(re.sub(r"_(bucket|sum|count|total)$", "", name))
    titles = " | ".join(p["title"] for p in panels).lower()
    for what in ("ttft", "itl", "tpot", "tokens per second", "running and waiting", "queue", "kv cache usage",
                 "kv transfer bytes", "kv transfer latency"):
        assert what in titles, what
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
                   "generation_tokens", "num_requests_waiting", "kv_cache_usage_perc", "kv_transfer_bytes",
                   "kv_transfer_seconds"):
        assert f"pdserve:{metric}" in used, metric
    assert any("by (role" in t["expr"] for p in panels for t in p["targets"])   # per role
    grid = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]]
    assert len(grid) == len(set(grid))


def test_images_build_kernels_use_cpu_torch_and_run_unprivileged() -> None:
    for path in (ROOT / "deploy/docker/Dockerfile", ROOT / "deploy/ray/Dockerfile"):
        text = path.read_text()
        assert "g++" in text, path                       # the native CPU kernels build at start
        assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text, path
        assert '--index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"' in text, path
        assert "COPY" in text and "LICENSE" in text, path  # pyproject's license-files
        users = re.findall(r"^USER (\S+)", text, re.M)
        assert users and users[-1] not in ("root", "0"), path
    ignore = (ROOT / ".dockerignore").read_text().split()
    for entry in ("**/.venv", ".git", "**/__pycache__", "models", ".env"):
        assert entry in ignore, entry
    compose = _compose()
    for name in ("router", "prefill", "decode", "prometheus", "grafana"):
        assert compose["services"][name]["healthcheck"]["test"][0] == "CMD", name


def _compose_cli() -> list[str] | None:
    import shutil
    import subprocess
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.skipif(_compose_cli() is None, reason="neither `docker compose` nor docker-compose is installed")
@pytest.mark.parametrize("with_env", [False, True])
def test_compose_cli_validates_the_file(tmp_path: Path, with_env: bool) -> None:
    """`docker compose config` (no daemon needed), without .env and with .env.example as .env."""
    import shutil
    import subprocess
    for name in ("docker-compose.yml", ".env.example"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    if with_env:
        shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    res = subprocess.run([*_compose_cli(), "config", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_compose_is_the_default_topology() -> None:
    """Compose's roles, gRPC ports and metrics ports are services/common/topology.py's default shape and
    port layout (the router on 50051 / 9100, then prefill-0, decode-0), and the router reaches the
    workers by their compose names."""
    from pdserve.services.common.topology import ROUTER_PORT, SERVE_HTTP_PORT, Topology
    topology = Topology()
    compose = _compose()
    services = compose["services"]
    by_service = {"router": "router", **{f"{role}-0": role for role, _ in topology.roles()}}
    assert set(by_service.values()) <= set(services)
    flag_value = lambda cmd, flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    grpc = {name: int(flag_value(services[svc]["command"], "--port")) for name, svc in by_service.items()}
    assert grpc == topology.port_layout(ROUTER_PORT)
    metrics = _metrics_ports(compose)
    assert {name: metrics[svc] for name, svc in by_service.items()} == topology.port_layout(metrics["router"])
    router = services["router"]["command"]
    for role, _ in topology.roles():
        assert flag_value(router, f"--{role}") == f"{role}:{grpc[f'{role}-0']}"
    assert int(flag_value(router, "--http-port")) == SERVE_HTTP_PORT


def test_every_service_runs_under_an_init_and_grafana_is_an_optional_profile() -> None:
    """A Python PID 1 ignores SIGTERM (`down` would wait out each service's stop timeout); Grafana
    has no package here, so `docker compose up` starts it only with --profile grafana."""
    services = _compose()["services"]
    assert [name for name, svc in services.items() if svc.get("init") is not True] == []
    assert [name for name, svc in services.items() if svc.get("profiles")] == ["grafana"]
    assert services["grafana"]["profiles"] == ["grafana"]
    prom = services["prometheus"]
    assert prom["entrypoint"] == ["prometheus"] and "--storage.tsdb.path=/prometheus" in prom["command"]
