"""deploy/ray and docs/ray.md: the configs parse, keep token auth on and ports on loopback or
inside the cluster, and every `pdserve ray ...` command they show parses with the CLI."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from pdserve.services.cli.commands import build_parser
from pdserve.services.cli.ray_cmd import ray_spec

ROOT = Path(__file__).resolve().parents[3]
RAY_DIR = ROOT / "deploy" / "ray"


def _pdserve_commands(text: str) -> list[list[str]]:
    """`pdserve ray up|down|status ...` commands in text, continuation lines joined."""
    text = re.sub(r"\\\s*\n\s*#?\s*", " ", text)          # join `\`-continued lines (also inside comments)
    return [shlex.split(m.group(1).split(" #")[0])
            for m in re.finditer(r"pdserve (ray (?:up|down|status)\b[^\"\n`|]*)", text)]


def _code(path: Path) -> str:
    """Markdown: its fenced code blocks; anything else: all of it."""
    text = path.read_text()
    return "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, re.S)) if path.suffix == ".md" else text


def test_documented_commands_parse() -> None:
    parser = build_parser()
    sources = [ROOT / "docs" / "ray.md", RAY_DIR / "cluster.yaml", RAY_DIR / "kuberay.yaml"]
    commands = [c for src in sources for c in _pdserve_commands(_code(src))]
    assert sum(c[:2] == ["ray", "up"] and "--model" in c for c in commands) >= 3
    for argv in commands:
        args = parser.parse_args(argv)
        if args.command == "ray" and args.ray_command == "up":
            spec = ray_spec(args, "/models/m")
            assert spec.kv_transport == "ray"
            # a worker host beyond loopback is always spelled out
            assert spec.worker_host in ("127.0.0.1", "node-ip"), argv


def test_cluster_launcher_config_keeps_token_auth_and_loopback_dashboard() -> None:
    cfg = yaml.safe_load((RAY_DIR / "cluster.yaml").read_text())
    assert cfg["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    ray_starts = [c for c in starts if "ray start" in c]
    assert len(ray_starts) == 2 and all("RAY_AUTH_MODE=token ray start" in c for c in ray_starts)
    assert "--dashboard-host=127.0.0.1" in cfg["head_start_ray_commands"][-1]
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types and {"cpu_worker", "gpu_worker"} <= set(types)


def _token_env(container: dict) -> bool:
    env = {e["name"]: e for e in container.get("env", [])}
    return (env.get("RAY_AUTH_MODE", {}).get("value") == "token"
            and env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {}).get("name")
            == "pdserve-ray-auth")


def test_kuberay_manifest_deploys_declaratively() -> None:
    """No `kubectl exec` step: a submitter runs an idempotent `pdserve ray up` in a loop (so a head
    restart is followed by a redeploy), with the cluster's token from the same secret as Ray's."""
    text = (RAY_DIR / "kuberay.yaml").read_text()
    assert "kubectl exec" not in text
    docs = {d["kind"]: d for d in yaml.safe_load_all(text)}
    submitter = docs["Deployment"]["spec"]
    assert submitter["replicas"] == 1
    container = submitter["template"]["spec"]["containers"][0]
    assert _token_env(container)
    script = container["command"][2]
    assert container["command"][:2] == ["sh", "-c"] and script.startswith("while true;") and "sleep" in script
    argv = shlex.split(script.split(" do ", 1)[1].split(";", 1)[0])
    assert argv[0] == "pdserve"
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.ray_command, args.if_exists) == ("ray", "up", "keep")
    assert args.address == "ray://pdserve-head-svc:10001" and args.model.startswith("/models/")
    spec = ray_spec(args, args.model)
    assert spec.kv_transport == "ray" and spec.worker_host == "node-ip"
    labels = submitter["template"]["metadata"]["labels"]
    policy = docs["NetworkPolicy"]["spec"]["ingress"]
    assert any(rule["from"][0]["podSelector"]["matchLabels"] == labels
               and rule["ports"] == [{"protocol": "TCP", "port": 10001}] for rule in policy)
    head_ports = {p["containerPort"] for p in
                  docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert 10001 in head_ports


def test_kuberay_manifest() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((RAY_DIR / "kuberay.yaml").read_text())}
    cluster = docs["RayCluster"]["spec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert all(_token_env(c) for pod in pods for c in pod["spec"]["containers"])   # token auth everywhere
    assert tuple(int(x) for x in cluster["rayVersion"].split(".")) >= (2, 52)
    assert cluster["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    gpu = groups["gpu-workers"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    cpu = groups["cpu-workers"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu.get("nvidia.com/gpu") == 1 and "nvidia.com/gpu" not in cpu
    for pod in [cluster["headGroupSpec"]["template"]] + [g["template"] for g in groups.values()]:
        mounts = {m["mountPath"] for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])}
        assert "/models" in mounts   # the shared model path on every node
    service = docs["Service"]["spec"]
    assert service["type"] == "ClusterIP" and service["selector"]["ray.io/node-type"] == "head"
    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"ray.io/cluster": "pdserve"}
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadOnlyMany"]
