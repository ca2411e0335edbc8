"""services.common.topology: each deployment default declared once, one way to build a child's argv, and
the parser's configs torch-free (this file also runs as a script)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.services.common.config_flags import config_to_argv, configs_from_argv, field_default
from pdserve.services.deployment.launcher import Cluster, Deployment
from pdserve.services.ray_deploy.deploy import RayDeployment
from pdserve.services.router.config import RouterConfig
from pdserve.services.common.topology import DRAIN_TIMEOUT_S, ROUTER_PORT, Topology, flags_argv, role_argv
from pdserve.services.workers.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[3]


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def test_drain_timeout_is_declared_once():
    fields = [_field(cls, "drain_timeout_s") for cls in (WorkerConfig, RouterConfig, Deployment)]
    assert {f.default for f in fields} == {DRAIN_TIMEOUT_S}
    assert len({f.metadata["help"] for f in fields}) == 1


def test_router_port_and_host_defaults_are_shared():
    assert field_default(Deployment, "port") == field_default(RayDeployment, "port") == ROUTER_PORT
    assert field_default(Deployment, "host") == field_default(RayDeployment, "host")


def test_generate_max_tokens_is_the_sampling_default():
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.services.cli.commands import build_parser
    args = build_parser("generate").parse_args(["generate", "hi"])
    assert args.max_tokens == SamplingParams().max_tokens


def test_flags_argv_forms():
    assert flags_argv(a_b=1, c=None, on=True, off=False, many=("x", "y")) == \
        ["--a-b", "1", "--on", "--no-off", "--many", "x", "y"]
    assert role_argv("worker", WorkerConfig(kv_lease_idle_s=4), role="decode") == \
        ["worker", "--role", "decode", "--kv-lease-idle-s", "4"]


def test_role_argv_round_trips_through_the_generated_flags():
    engine = EngineConfig(model="/m", block_size=32, max_num_seqs=3)
    worker = WorkerConfig(kv_shared_memory=False, drain_timeout_s=7.0)
    argv = role_argv("worker", engine, exclude=("model", "role")) + config_to_argv(worker)
    rebuilt_engine, rebuilt_worker = configs_from_argv(argv[1:], (EngineConfig, ("model", "role")), (WorkerConfig, ()),
                                                       model="/m")
    assert (rebuilt_engine, rebuilt_worker) == (engine, worker)


def test_launcher_builds_children_argv_from_its_spec():
    spec = Deployment(model="/m", prefill_tp=2, drain_timeout_s=5.0, threads_per_worker=2,
                      engine_args=["--block-size", "32"], router_args=["--max-queued-requests", "3"])
    cluster = Cluster(spec)
    try:
        worker = cluster.worker_argv("prefill", "prefill-0")
        assert worker[:3] == ["worker", "--role", "prefill"]
        assert worker[-2:] == ["--tensor-parallel-size", "2"]   # last: wins over the engine's own flag
        assert "--block-size" in worker and worker[worker.index("--drain-timeout-s") + 1] == "5.0"
        assert "--tensor-parallel-size" not in cluster.worker_argv("decode", "decode-0")
        router = cluster.router_argv({"prefill": ["a:1", "b:2"], "decode": ["c:3"]}, 12.0)
        assert router[:3] == ["router", "--model", "/m"]
        assert router[router.index("--prefill") + 1] == "a:1,b:2" and "--colocated" not in router
        assert router[router.index("--worker-wait-s") + 1] == "12.0"
    finally:
        cluster.ports.close()
    given = Cluster(Deployment(model="/m", router_args=["--worker-wait-s", "3"]))
    try:
        assert given.router_argv({}, 12.0).count("--worker-wait-s") == 1
    finally:
        given.ports.close()


def test_topology_shape_and_port_layout():
    t = Topology(prefill_workers=2, decode_workers=1, prefill_tp=2, engine_tp=1)
    assert t.roles() == [("prefill", 2), ("decode", 1)] and t.num_workers == 3
    assert (t.tp("prefill"), t.tp("decode")) == (2, 1)
    assert t.port_layout(9100) == {"router": 9100, "prefill-0": 9101, "prefill-1": 9102, "decode-0": 9103}
    assert Topology(colocated_workers=2).names() == ["router", "both-0", "both-1"]
    with pytest.raises(ValueError, match="needs prefill_workers >= 1 and decode_workers >= 1"):
        Topology(decode_workers=0)
    with pytest.raises(ValueError, match="decode_tp must be >= 1"):
        Topology(decode_tp=0)


def test_up_and_ray_up_read_the_same_topology():
    up = Deployment(model="/m", prefill_workers=2, decode_tp=2)
    ray = RayDeployment(model="/m", prefill_workers=2, decode_tp=2)
    assert up.topology == ray.topology
    assert up.metrics_ports() == {} and Deployment(model="/m", metrics_port_base=9100).metrics_ports() == \
        Topology().port_layout(9100)
    assert (ray.tp("prefill"), ray.tp("decode")) == (1, 2)


@pytest.mark.parametrize("command", ["up", "serve", "router", "worker", "ray", "profile"])
def test_building_a_commands_parser_imports_no_torch(command):
    code = ("import sys\nfrom pdserve.services.cli.commands import build_parser\n"
            f"build_parser({command!r})\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def test_no_import_cycle_through_the_cli():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_code_shape
    finally:
        sys.path.pop(0)
    found = [c for c in test_code_shape.cycles(test_code_shape.import_graph())
             if any(m.startswith(("pdserve.services.cli", "pdserve.services.planner", "pdserve.services.ray_deploy")) for m in c)]
    assert not found, found


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_workers_own_address_is_a_flag_of_its_role_never_of_up() -> None:
    from pdserve.services.cli.commands import build_parser
    parser = build_parser()
    assert parser.parse_args(["decode", "--kv-advertise-address", "10.0.0.9:7300"]).kv_advertise_address == "10.0.0.9:7300"
    for command in (["up"], ["ray", "up"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--kv-advertise-address", "10.0.0.9:7300"])
    assert WorkerConfig(kv_advertise_address="[::1]:7300").kv_advertise_address == "[::1]:7300"
    for bad in ("10.0.0.9", "10.0.0.9:0", "10.0.0.9:70000", ":7300", "host:port"):
        with pytest.raises(ValueError, match="kv_advertise_address must be HOST:PORT"):
            WorkerConfig(kv_advertise_address=bad)
