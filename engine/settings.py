"""Where a setting is declared: the one field helper every config dataclass uses.

A setting is a dataclass field whose metadata holds its help text (and, optionally, ``choices``,
``aliases``, ``metavar`` or ``cli=False``); the command-line flags are generated from these
(services/config_cli.py), so each default is written once, where the field is declared.
This module imports nothing heavy: the CLI's ``--help`` reads it without torch.
"""
from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A config field with its default and help text."""
    return field(default=default, metadata={"help": help, **meta})
