"""One source of truth for settings: every field of every config dataclass is a flag of every
command that uses it (generated from the dataclass), and the form children and Ray actors get
(argv from config_to_argv) parses back, with the same generated flags, to the same config."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.services.cli.commands import build_parser
from pdserve.services.common.config_flags import config_fields, config_to_argv, configs_from_argv, flag
from pdserve.services.router.config import GenerationOptions
from pdserve.services.deployment.launcher import Deployment
from pdserve.services.ray_deploy.deploy import RayDeployment
from pdserve.services.api.request_limits import RequestLimits
from pdserve.services.router.config import RouterConfig
from pdserve.services.workers.config import WorkerConfig

WORKER = (EngineConfig, WorkerConfig)
ROUTER = (RouterConfig, GenerationOptions, RequestLimits)
ENTRY_POINTS = {
    ("up",): (*WORKER, *ROUTER, Deployment),
    ("worker",): WORKER, ("prefill",): WORKER, ("decode",): WORKER,
    ("router",): ROUTER,
    ("generate",): (EngineConfig,),
    ("ray", "up"): (*WORKER, *ROUTER, RayDeployment),
}
# Fields an entry point sets another way, and the flag that does it.
OTHERWISE = {
    "model": "--model",                                   # every command: the checkpoint
    "role": None,                                         # the subcommand (worker: --role)
    ("up", "num_threads"): "--threads-per-worker",        # per worker process
    ("ray", "up", "name"): "--name", ("ray", "up", "namespace"): "--namespace",
    # one worker's own addresses: given per worker (`pdserve decode`), never to a whole deployment
    **{(*command, name): None for command in (("up",), ("ray", "up"))
       for name in ("kv_advertise_address", "router", "advertise_address")},
}


def _subparser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("path", list(ENTRY_POINTS), ids=" ".join)
def test_every_field_is_a_flag_of_every_entry_point(path: tuple[str, ...]) -> None:
    parser = _subparser(path)
    options = {s for a in parser._actions for s in a.option_strings}
    missing = []
    for cls in ENTRY_POINTS[path]:
        for f in dataclasses.fields(cls):
            if not f.init or not f.metadata.get("cli", True):
                continue
            other = OTHERWISE.get((*path, f.name), OTHERWISE.get(f.name, flag(f.name)))
            if other is None:
                continue
            if other not in options:
                missing.append(f"{cls.__name__}.{f.name} ({other})")
    assert not missing, f"pdserve {' '.join(path)} lacks: {', '.join(missing)}"


def _non_default(cls: type):
    """An instance with every simple field changed from its default (valid values)."""
    values = {}
    for f, tp in config_fields(cls):
        default = f.default
        if isinstance(default, bool):
            values[f.name] = not default
        elif isinstance(default, int) and f.name not in ("role",):
            values[f.name] = default + 3
        elif isinstance(default, float):
            values[f.name] = min(1.0, default * 0.5) if "utilization" in f.name else default + 1.5
    return values


@pytest.mark.parametrize("cls", [EngineConfig, WorkerConfig, RouterConfig, GenerationOptions, RequestLimits])
def test_argv_round_trip_through_the_generated_parser(cls: type) -> None:
    fixed = {"model": "/m"} if cls is EngineConfig else {}
    obj = cls(**fixed, **_non_default(cls))
    argv = config_to_argv(obj, exclude=("model",))
    assert argv, "every changed field is written"
    (back,) = configs_from_argv(argv, (cls, ("model",)), **fixed)
    assert back == obj


def test_up_forwards_engine_settings_to_its_workers_as_their_cli_parses_them() -> None:
    """`pdserve up --block-size 8 ...` -> the argv a worker gets -> `pdserve worker`'s own parser."""
    from pdserve.services.common.topology import ENGINE_FIXED
    from pdserve.services.common.config_flags import config_from_args, given

    up = build_parser().parse_args(["up", "--block-size", "8", "--no-enable-prefix-caching", "--dtype", "float32",
                                    "--kv-lease-idle-s", "4"])
    engine = EngineConfig(model="/m", **given(up, EngineConfig, ENGINE_FIXED))
    argv = ["worker", "--role", "decode", "--model", "/m", *config_to_argv(engine, exclude=ENGINE_FIXED),
            *config_to_argv(config_from_args(WorkerConfig, up))]
    worker = build_parser().parse_args(argv)
    assert EngineConfig(model="/m", role="decode", **given(worker, EngineConfig, ENGINE_FIXED)) == \
        dataclasses.replace(engine, role="decode")
    assert config_from_args(WorkerConfig, worker).kv_lease_idle_s == 4


def test_ray_up_hands_actors_argv_parsed_like_the_cli() -> None:
    from pdserve.services.ray_deploy.actors import router_configs, worker_configs
    from pdserve.services.cli.ray_cmd import ray_spec

    args = build_parser().parse_args(["ray", "up", "--block-size", "8", "--kv-lease-max-s", "100",
                                      "--stall-timeout-s", "4", "--max-prompt-bytes", "4096", "--worker-wait", "7",
                                      "--timeout", "99"])
    spec = ray_spec(args, "/m")
    engine_args, worker_args, router_args = spec.role_argv(worker_cpus=0.5)
    engine, worker = worker_configs({"role": "prefill", "engine_args": engine_args, "worker_args": worker_args}, "/m")
    assert (engine.block_size, engine.num_threads, engine.role) == (8, 1, "prefill")
    assert worker.kv_lease_max_s == 100
    generation, limits, router = router_configs({"router_args": router_args})
    assert (generation.stall_timeout_s, generation.worker_wait_s) == (4, 7)
    assert limits.max_prompt_bytes == 4096 and router.ready_timeout_s == 99
    assert spec.ready_timeout_s == 99


def test_ray_up_takes_per_role_tp_and_sizes_each_workers_bundle_by_its_ranks() -> None:
    """`pdserve ray up --prefill-tp/--decode-tp` as `pdserve up`; a worker's bundle holds all its ranks."""
    from pdserve.services.cli.ray_cmd import ray_spec
    from pdserve.services.ray_deploy.deploy import HEAD_RESOURCE, PIN, resolve_cpus

    spec = ray_spec(build_parser().parse_args(["ray", "up", "--tensor-parallel-size", "2", "--decode-tp", "1"]), "/m")
    assert (spec.tp("prefill"), spec.tp("decode"), spec.num_ranks) == (2, 1, 3)
    assert spec.worker_bundle("prefill", 0.5, 0) == {"CPU": 1.0, HEAD_RESOURCE: PIN}   # loopback: on the head
    assert spec.worker_bundle("decode", 0.5, 0) == {"CPU": 0.5, HEAD_RESOURCE: PIN}
    assert spec.worker_bundle("prefill", 2, 1)["GPU"] == 2                              # one GPU per rank
    spec = ray_spec(build_parser().parse_args(["ray", "up", "--prefill-tp", "2", "--worker-host", "node-ip"]), "/m")
    assert (spec.tp("prefill"), spec.tp("decode")) == (2, 1)
    assert spec.worker_bundle("prefill", 1, 0) == {"CPU": 2}
    # unset CPUs on a head that holds everything: equal shares per rank (2 + 1) and the router
    spec = ray_spec(build_parser().parse_args(["ray", "up", "--prefill-tp", "2"]), "/m")
    assert resolve_cpus(spec, 2.0) == (0.5, 0.5)
    with pytest.raises(ValueError, match="decode_tp must be an integer >= 1"):
        RayDeployment(model="/m", decode_tp=0).validate()
    with pytest.raises(ValueError, match="worker_gpus must be a whole number"):
        RayDeployment(model="/m", decode_tp=2, worker_gpus=0.5).validate()
    RayDeployment(model="/m", decode_tp=2, worker_gpus=1).validate()


def test_environment_variables_are_documented() -> None:
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    help_text = build_parser().format_help()
    for var in ("PDSERVE_HOME", "PDSERVE_LOG_LEVEL", "PDSERVE_CLUSTER_TOKEN", "PDSERVE_API_KEY"):
        assert var in help_text and var in readme, var


def test_speculative_config_is_a_json_flag_that_round_trips() -> None:
    """`--speculative-config JSON` (vLLM's) on a command that runs an engine, back through the argv
    children and Ray actors get, and through the JSON a tensor-parallel rank gets."""
    import json

    from pdserve.engine.spec_decode.config import SpeculativeConfig
    from pdserve.services.common.config_flags import config_from_args, given

    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 1}'
    args = build_parser().parse_args(["worker", "--role", "decode", "--speculative-config", text])
    engine = EngineConfig(model="/m", **given(args, EngineConfig, ("model", "role")))
    want = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5, prompt_lookup_min=1)
    assert engine.speculative_config == want
    argv = config_to_argv(engine, exclude=("model",))
    assert argv == ["--speculative-config", want.to_json()]
    (back,) = configs_from_argv(argv, (EngineConfig, ("model",)), model="/m")
    assert back == engine
    assert EngineConfig(**json.loads(json.dumps(dataclasses.asdict(engine)))) == engine   # engine/parallel.py's form
    assert config_from_args(EngineConfig, build_parser().parse_args(["generate", "x"]), ("model",),
                            model="/m").speculative_config is None
    with pytest.raises(SystemExit):   # argparse names the flag and the field
        build_parser().parse_args(["worker", "--speculative-config", '{"num_speculative_tokens": 0}'])
