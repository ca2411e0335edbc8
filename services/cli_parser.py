"""The `pdserve` argument parser: one-line usage errors (exit 2) that point to the subcommand's
help, and every flag's help ending with its default."""
from __future__ import annotations

import argparse
from typing import NoReturn

from services.usage import EXIT_USAGE


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
