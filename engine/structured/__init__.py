"""Structured outputs: the output follows a JSON schema, a regex, a choice or a grammar.

xgrammar (chosen by the measurements in bench/grammar_backends.py, docs/benchmarks.md) compiles
a request's constraint (grammars.py, cached per vocabulary) and keeps one matcher per sequence
(state.py); each step the runner fills the sequence's rows of a token bitmask and the sampler
applies it (bitmask.py) in the batch with rows that have none.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.lazy_exports import lazy_getattr

# imported on first use: the router needs only constraints (no torch), the workers all of it
_EXPORTS = {"Grammars": "pdserve.engine.structured.grammars", "GrammarState": "pdserve.engine.structured.state",
            "StructuredError": "pdserve.engine.structured.constraints",
            "check_structured": "pdserve.engine.structured.constraints"}
__all__ = ["Grammars", "GrammarState", "StructuredError", "check_structured"]

if TYPE_CHECKING:
    from pdserve.engine.structured.constraints import StructuredError, check_structured
    from pdserve.engine.structured.grammars import Grammars
    from pdserve.engine.structured.state import GrammarState

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
