"""A deployment's shape and the defaults its roles share, declared once, torch-free.

`pdserve up` (services/launcher.py), `pdserve ray up` (services/ray_deploy/), the compose file and
hand-started roles (`pdserve router`, `pdserve prefill`, ...) read the addresses, ports and drain
time from here, and build each child's command line with ``role_argv`` (flags from the config
dataclasses through services/config_cli.config_to_argv). Importing this module imports no torch:
`pdserve up --help` reads it.
"""
from __future__ import annotations

from typing import Any

from engine.settings import setting
from services.config_cli import config_to_argv, flag

DEFAULT_HOST = "127.0.0.1"        # every process binds loopback unless told otherwise
ROUTER_PORT = 50051               # the router's public gRPC port
SERVE_HTTP_PORT = 8000            # `pdserve serve`: the OpenAI HTTP API's port, as `vllm serve`
DRAIN_TIMEOUT_S = 30.0            # router and workers: on SIGTERM, in-flight requests get this long
ROLES = ("prefill", "decode", "both")

ENGINE_FIXED = ("model", "role")  # EngineConfig fields set by --model and the subcommand, never as flags
UP_PER_PROCESS = ("num_threads",)  # set by `up` per worker (threads_per_worker), not forwarded as given
UP_OWN = ("drain_timeout_s",)     # set by `up` on every child from its Deployment


def drain_timeout_setting() -> Any:
    """The drain-time field every role's config declares (one default, one help text)."""
    return setting(DRAIN_TIMEOUT_S, "on SIGTERM, in-flight requests get this long to finish")


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
