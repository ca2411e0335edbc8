"""Where a setting is declared: the one field helper every config dataclass uses, and the one
registry of environment variables (``ENV``).

A setting is a dataclass field whose metadata holds its help text (and, optionally, ``choices``,
``aliases``, ``metavar`` or ``cli=False``); the command-line flags are generated from these
(services/common/config_flags.py), so each default is written once, where the field is declared.
This module imports nothing heavy: the CLI's ``--help`` reads it without torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A config field with its default and help text."""
    return field(default=default, metadata={"help": help, **meta})


# ---- environment variables ---------------------------------------------------------
# Every environment variable pdserve reads is declared here once, typed, with its default and
# help (the model: mini-sglang's env.py); readers call ``ENV.X.get()``, never os.environ
# (tests/engine/test_settings_registry.py checks engine/ and services/). Copying the whole
# environment for a child process (``{**os.environ, ...}``) is the one other use.

def _flag(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class EnvVar(Generic[T]):
    """One environment variable: its name, how its text parses, its default when unset or empty."""

    name: str
    default: T
    help: str
    parse: Callable[[str], T] = str  # type: ignore[assignment]
    internal: bool = False   # set by pdserve for its own processes, or another tool's: not listed for users

    def raw(self) -> str | None:
        """The text as set, or None when unset or blank."""
        text = os.environ.get(self.name)
        return text if text is not None and text.strip() else None

    def get(self) -> T:
        text = self.raw()
        if text is None:
            return self.default
        try:
            return self.parse(text.strip())
        except ValueError as exc:
            raise ValueError(f"${self.name}: {exc}") from None

    def is_set(self) -> bool:
        return self.raw() is not None

    def set(self, value: Any) -> None:
        """Set it in this process's environment (the processes it starts inherit it)."""
        os.environ[self.name] = str(value)

    def env(self, value: Any) -> dict[str, str]:
        """{name: value}, for a child's environment."""
        return {self.name: str(value)}


class ENV:
    """The registry: one EnvVar per variable. ``ENV.all()`` lists them (for help and docs)."""

    HOME = EnvVar("PDSERVE_HOME", "~/.cache/pdserve",
                  "models, logs, kernel builds, profiles and local Ray state (default ~/.cache/pdserve)")
    LOG_LEVEL = EnvVar("PDSERVE_LOG_LEVEL", "WARNING",
                       "DEBUG, INFO, WARNING, ERROR or CRITICAL, handed by `up` and `ray up` to their processes")
    CLUSTER_TOKEN = EnvVar("PDSERVE_CLUSTER_TOKEN", None, "the internal plane's secret (`up` makes one per "
                           "deployment, --cluster-token-file wins)")
    ADMIN_TOKEN = EnvVar("PDSERVE_ADMIN_TOKEN", None, "the router's membership-admin secret, apart from the cluster "
                         "token: `pdserve workers` and the planner prove it to add, drain, remove or re-role "
                         "workers (`up` makes one per deployment for its router; --admin-token-file wins)")
    API_KEY = EnvVar("PDSERVE_API_KEY", None, "the router's API key (clients send it as a bearer token)")
    OPENAI_API_KEY = EnvVar("OPENAI_API_KEY", None, "the load generator's API key for an OpenAI-compatible server "
                            "(before $PDSERVE_API_KEY)", internal=True)
    METRICS_TOKEN = EnvVar("PDSERVE_METRICS_TOKEN", None, "scrapes of /metrics must send this bearer token")
    PARENT_PID = EnvVar("PDSERVE_PARENT_PID", None, "set by `pdserve up` in its children: they die with it",
                        parse=int, internal=True)
    RESERVED_PORTS = EnvVar("PDSERVE_RESERVED_PORTS", (), "ports the supervisor reserved for this child "
                            "(comma-separated; set by `pdserve up`)",
                            parse=lambda s: tuple(int(p) for p in s.split(",") if p.strip().isdigit()),
                            internal=True)
    CPU_KERNELS = EnvVar("PDSERVE_CPU_KERNELS", True, "0: never build or use the C++ CPU kernels", parse=_flag)
    CXX = EnvVar("CXX", "c++", "the C++ compiler the CPU kernels are built with", internal=True)
    TEST_ENGINE_HANG_DIR = EnvVar("PDSERVE_TEST_ENGINE_HANG_DIR", None, "tests only: a worker's engine thread "
                                  "hangs, holding the engine lock, before its next step while a file "
                                  "DIR/engine-hang-PID (PID: the worker's, owned by its user) exists",
                                  internal=True)
    # Ray's own variables, which `pdserve ray` reads and sets for the processes it starts.
    RAY_AUTH_TOKEN = EnvVar("RAY_AUTH_TOKEN", None, "Ray: the cluster's auth token", internal=True)
    RAY_AUTH_TOKEN_PATH = EnvVar("RAY_AUTH_TOKEN_PATH", None, "Ray: a file holding the cluster's auth token",
                                 internal=True)
    RAY_AUTH_MODE = EnvVar("RAY_AUTH_MODE", None, "Ray: `token` for a token-authenticated cluster", internal=True)
    RAY_LOOPBACK = EnvVar("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None, "Ray: 0 keeps a local head on loopback",
                          internal=True)

    # huggingface_hub's own, read when a Hub id is resolved (engine/checkpoints/hub.py), at that time
    # rather than at huggingface_hub's import.
    HF_ENDPOINT = EnvVar("HF_ENDPOINT", None, "Hugging Face Hub: its address (a mirror)", internal=True)
    HF_HOME = EnvVar("HF_HOME", None, "Hugging Face: its cache root", internal=True)
    HF_HUB_CACHE = EnvVar("HF_HUB_CACHE", None, "Hugging Face Hub: its download cache", internal=True)

    @classmethod
    def all(cls) -> list[EnvVar]:
        return [v for v in vars(cls).values() if isinstance(v, EnvVar)]

    @classmethod
    def documented(cls) -> str:
        """The user-facing variables, one `NAME: help` clause each (`pdserve --help`'s epilog)."""
        return "; ".join(f"{v.name}: {v.help}" for v in cls.all() if not v.internal)

    @classmethod
    def named(cls, name: str) -> EnvVar:
        """The registered variable called name (KeyError: every variable read is declared here)."""
        for var in cls.all():
            if var.name == name:
                return var
        raise KeyError(f"environment variable {name} is not declared in engine.settings.ENV")


def pdserve_home() -> Path:
    """``$PDSERVE_HOME`` or ``~/.cache/pdserve``."""
    return Path(ENV.HOME.get()).expanduser()
