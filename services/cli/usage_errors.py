"""Ordinary mistakes said in one line: what is wrong and what to do about it.

The CLI turns these exceptions into one ``pdserve: error: ...`` line on stderr (no traceback)
and an exit code: 2 for a usage error (a flag, a path, a setting the user can fix in the
command line), 1 for a runtime failure (the router is unreachable, a deployment failed).
"""
from __future__ import annotations

from pdserve.services.common.log_format import configure as _configure_logging

EXIT_RUNTIME = 1
EXIT_USAGE = 2
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class UsageError(Exception):
    """A mistake in the command line: exit code 2."""

    exit_code = EXIT_USAGE


class RuntimeFailure(Exception):
    """Something the command needed failed (unreachable router, failed deployment): exit code 1."""

    exit_code = EXIT_RUNTIME


def parse_log_level(text: str) -> str:
    """DEBUG, INFO, ... in any case; ValueError naming the choices otherwise."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def configure_logging(level: str) -> None:
    """The root logger at level; control characters in messages escaped (services/common/log_format.py)."""
    _configure_logging(level)
