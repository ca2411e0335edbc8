"""The `pdserve` argument parser: one-line usage errors (exit 2) that point to the subcommand's
help, and every flag's help ending with its default; the --model and engine flags every command
that runs the engine has (`pdserve up`, `ray up`, `profile`, ...)."""
from __future__ import annotations

import argparse
from typing import Any, NoReturn

from pdserve.engine.config import EngineConfig
from pdserve.services.api.request_limits import RequestLimits
from pdserve.services.cli.usage_errors import EXIT_USAGE, check_model_dir
from pdserve.services.common.config_flags import add_config_args, config_from_args, config_to_argv
from pdserve.services.common.topology import ENGINE_FIXED
from pdserve.services.deployment.progress import Progress
from pdserve.services.router.config import GenerationOptions, RouterConfig


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default (unless the help already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "(default" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        elif action.default is None:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class CLIParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (what is wrong, where help is), exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, and the namespace names the (sub)parser that parsed it, so that an error
        found after parsing points to that subcommand's help (`pdserve up --help`)."""
        namespace, rest = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "_parser") or getattr(namespace, "_parser") is None:
            namespace._parser = self
        return namespace, rest


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="local Hugging Face checkpoint directory (default: a tiny random-weight Qwen3, made under "
                        "$PDSERVE_HOME on first use)")


def add_engine_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """--model and the engine's generated flags (EngineConfig's fields but the fixed ones)."""
    add_model_arg(p)
    add_config_args(p.add_argument_group("engine"), EngineConfig, exclude=(*ENGINE_FIXED, *exclude))


def model_dir(args: argparse.Namespace, check: bool = True) -> str:
    """--model, checked (one line saying what is wrong), or the default model, made on first use."""
    if args.model:
        return check_model_dir(args.model) if check else args.model
    from pdserve.engine.model_maker import default_model_dir, ensure_default_model   # lazy: torch only when this runs
    if default_model_dir().is_dir():
        return str(default_model_dir())
    with Progress().step(f"making the default model in {default_model_dir()} (first run only)"):
        return str(ensure_default_model())


def add_router_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """The router's generated flags (`pdserve router`, `up`, `ray up`): RouterConfig's (but exclude),
    GenerationOptions' and RequestLimits'."""
    add_config_args(p.add_argument_group("router"), RouterConfig, exclude=exclude)
    add_config_args(p.add_argument_group("generation"), GenerationOptions)
    add_config_args(p.add_argument_group("request limits"), RequestLimits)


def router_argv(args: argparse.Namespace, router: Any) -> list[str]:
    """The router's settings as given on this command line, as the argv of a router child (`up`) or
    actor (`ray up`): generation and request-limit flags, then router's own non-default fields."""
    return [*config_to_argv(config_from_args(GenerationOptions, args)),
            *config_to_argv(config_from_args(RequestLimits, args)), *config_to_argv(router)]
