"""A deployment's shape and the defaults its roles share, declared once, torch-free.

`pdserve up` (services/deployment/launcher.py), `pdserve ray up` (services/ray_deploy/), the compose file and
hand-started roles (`pdserve router`, `pdserve prefill`, ...) read the addresses, ports and drain
time from here, and build each child's command line with ``role_argv`` (flags from the config
dataclasses through services/config_cli.config_to_argv). Importing this module imports no torch:
`pdserve up --help` reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.settings import setting
from pdserve.services.common.config_flags import config_to_argv, flag

DEFAULT_HOST = "127.0.0.1"        # every process binds loopback unless told otherwise
ROUTER_PORT = 50051               # the router's public gRPC port
SERVE_HTTP_PORT = 8000            # `pdserve serve`: the OpenAI HTTP API's port, as `vllm serve`
DRAIN_TIMEOUT_S = 30.0            # router and workers: on SIGTERM, in-flight requests get this long
ROLES = ("prefill", "decode", "both")
WORKER_THREADS = 1                # torch threads per worker process unless told: none oversubscribes

ENGINE_FIXED = ("model", "role")  # EngineConfig fields set by --model and the subcommand, never as flags
UP_PER_PROCESS = ("num_threads",)  # set by `up` per worker (threads_per_worker), not forwarded as given
UP_OWN = ("drain_timeout_s",)     # set by `up` on every child from its Deployment
PER_WORKER = ("kv_advertise_address", "router", "advertise_address")   # one worker's own: never flags of `up`
ROLES_SHARED = ("otlp_endpoint", "otlp_insecure")   # declared by the router's and the workers' configs: one flag of `up` sets both


@dataclass(frozen=True, slots=True)
class Topology:
    """A deployment's shape: a router and its workers by role (N prefill + M decode, or K colocated),
    each role's tensor parallelism, and the router's address. `pdserve up` (Deployment.topology),
    `pdserve ray up` (RayDeployment.topology) and the compose file (tests/services/deployment/test_deploy_files.py) are
    this shape; the names and port layout below are the ones they all use."""

    prefill_workers: int = 1
    decode_workers: int = 1
    colocated_workers: int = 0
    prefill_tp: int | None = None      # none: engine_tp
    decode_tp: int | None = None
    engine_tp: int = 1                 # the engine's --tensor-parallel-size
    host: str = DEFAULT_HOST
    port: int = ROUTER_PORT

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers", "colocated_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.colocated_workers == 0 and (self.prefill_workers < 1 or self.decode_workers < 1):
            raise ValueError("a disaggregated deployment needs prefill_workers >= 1 and decode_workers >= 1")
        for name in ("prefill_tp", "decode_tp"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_workers(self) -> int:
        return self.colocated_workers or self.prefill_workers + self.decode_workers

    def tp(self, role: str) -> int:
        """The tensor_parallel_size of a role's workers."""
        own = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return own if own is not None else self.engine_tp

    def roles(self) -> list[tuple[str, int]]:
        """(role, count) in start order."""
        return ([("both", self.colocated_workers)] if self.colocated_workers
                else [("prefill", self.prefill_workers), ("decode", self.decode_workers)])

    def names(self) -> list[str]:
        """Every process's name: the router, then ROLE-I in start order."""
        return ["router"] + [f"{role}-{i}" for role, count in self.roles() for i in range(count)]

    def port_layout(self, base: int) -> dict[str, int]:
        """name -> port when ports are fixed: the router on base, the workers on base+1, base+2, ...
        (`up --metrics-port-base`, and compose's gRPC and metrics ports)."""
        return {name: base + i for i, name in enumerate(self.names())}


def drain_timeout_setting() -> Any:
    """The drain-time field every role's config declares (one default, one help text)."""
    return setting(DRAIN_TIMEOUT_S, "on SIGTERM, in-flight requests get this long to finish")


def otlp_endpoint_setting() -> Any:
    """The tracing field every role's config declares (one default, one help text)."""
    return setting(None, "export OpenTelemetry spans of every request to the OTLP/gRPC collector at HOST:PORT "
                         "(needs pdserve[tracing]): plaintext on loopback, else TLS (the deployment's --tls-* files, "
                         "or an https:// endpoint); none: no tracing, at no cost", metavar="HOST:PORT")


def otlp_insecure_setting() -> Any:
    """The flag that lets spans go in clear to a collector off loopback (services/common/tracing.py)."""
    return setting(False, "send spans to a non-loopback --otlp-endpoint in plaintext (refused at start without "
                          "it when the process has no TLS)")


def role_argv(command: str, *configs: Any, exclude: tuple[str, ...] = (), **flags: Any) -> list[str]:
    """A child's `pdserve` argv: the subcommand, flags_argv(**flags), then each config's non-default
    fields. The one way a `pdserve up`, `ray up` or planner child gets its settings."""
    argv = [command, *flags_argv(**flags)]
    for config in configs:
        argv += config_to_argv(config, exclude=exclude)
    return argv


def flags_argv(**flags: Any) -> list[str]:
    """Flags from name=value: None is left out, a bool is --name / --no-name, a list or tuple is
    several values after the flag (as config_to_argv writes a config's fields)."""
    argv: list[str] = []
    for name, value in flags.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            argv += [flag(name), *map(str, value)]
        else:
            argv += [flag(name), str(value)]
    return argv
