"""Ordinary mistakes said in one line: what is wrong and what to do about it.

The CLI turns these exceptions into one ``pdserve: error: ...`` line on stderr (no traceback)
and an exit code: 2 for a usage error (a flag, a path, a setting the user can fix in the
command line), 1 for a runtime failure (the router is unreachable, a deployment failed).
"""
from __future__ import annotations

import re
from pathlib import Path

from pdserve.services.common.log_format import configure as _configure_logging

EXIT_RUNTIME = 1
EXIT_USAGE = 2
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Files of which a Hugging Face checkpoint has at least one when it carries its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class UsageError(Exception):
    """A mistake in the command line: exit code 2."""

    exit_code = EXIT_USAGE


class RuntimeFailure(Exception):
    """Something the command needed failed (unreachable router, failed deployment): exit code 1."""

    exit_code = EXIT_RUNTIME


def looks_like_hub_id(text: str) -> bool:
    """ORG/NAME, as on the Hugging Face Hub (and not an existing local path)."""
    return bool(_HUB_ID.fullmatch(text)) and not Path(text).exists()


def check_model_dir(path: str, flag: str = "--model") -> str:
    """The checkpoint directory, or UsageError saying what is missing and how to fix it."""
    if looks_like_hub_id(path):
        raise UsageError(f"{flag} {path} looks like a Hugging Face Hub id, but pdserve reads local checkpoints "
                         f"only: download it with `hf download {path} --local-dir DIR` and pass "
                         f"{flag} DIR")
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such directory; give a local Hugging Face checkpoint directory "
                         f"(or leave {flag} out to use the tiny default model)")
    if not p.is_dir():
        raise UsageError(f"{flag} {path} is a file; give the checkpoint's directory")
    if not (p / "config.json").is_file():
        raise UsageError(f"{flag} {path} is not a Hugging Face checkpoint directory: it has no config.json")
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"{flag} {path} has no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}): copy the "
                         f"checkpoint's tokenizer files into it")
    if not any(p.glob("*.safetensors")):
        raise UsageError(f"{flag} {path} has no *.safetensors weights; pdserve loads safetensors checkpoints only")
    return str(p)


def parse_log_level(text: str) -> str:
    """DEBUG, INFO, ... in any case; ValueError naming the choices otherwise."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def configure_logging(level: str) -> None:
    """The root logger at level; control characters in messages escaped (services/common/log_format.py)."""
    _configure_logging(level)
