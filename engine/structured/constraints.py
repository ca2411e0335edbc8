"""A request's constraint as xgrammar reads it, checked without a vocabulary (the router's check,
before anything is queued). Nothing here needs torch: a router imports this at start and xgrammar
(which brings torch) only when it checks its first constraint, on a thread."""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Sequence

from pdserve.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

COMPILE_TIMEOUT_S = 10.0    # a caller waits this long for a check or a compile, then refuses the request
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")   # xgrammar's "[17:02:27] /project/cpp/x.cc:94: " prefix


class StructuredError(ValueError):
    """A constraint that does not compile; the message names the field (structured_outputs.KIND)."""


def field_name(kind: str) -> str:
    return f"structured_outputs.{kind}"


def reason(exc: Exception) -> str:
    """xgrammar's error, one line, its source location left out."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOCATION.sub("", text)[:200]


def choice_ebnf(choices: Sequence[str]) -> str:
    """root ::= "a" | "b" ...: each choice as an EBNF string literal (JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_of(spec: StructuredOutputsParams) -> "xgrammar.Grammar":
    import xgrammar as xgr
    kind, _ = spec.kind()
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
    return xgr.Grammar.from_ebnf(spec.grammar)


def check_structured(spec: StructuredOutputsParams) -> None:
    """Raise StructuredError naming the field if the constraint does not parse (no vocabulary
    needed: the router's check). JSON schema text must be a JSON object."""
    spec.validate()
    kind, text = spec.kind()
    if kind == "json":
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise StructuredError(f"{field_name(kind)} is not valid JSON: {exc.msg} at {exc.pos}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredError(f"{field_name(kind)} must be a JSON schema (an object)")
    try:
        grammar_of(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError (or ValueError) with the reason
        raise StructuredError(f"{field_name(kind)} does not compile: {reason(exc)}") from None
