"""Structured outputs: the output follows a JSON schema, a regex, a choice or a grammar.

xgrammar (chosen by the measurements in bench/grammar_backends.py, docs/benchmarks.md) compiles
a request's constraint (grammars.py, cached per vocabulary) and keeps one matcher per sequence
(state.py); each step the runner fills the sequence's rows of a token bitmask and the sampler
applies it (bitmask.py) in the batch with rows that have none.
"""
from pdserve.engine.structured.grammars import Grammars, StructuredError, check_structured
from pdserve.engine.structured.state import GrammarState

__all__ = ["Grammars", "GrammarState", "StructuredError", "check_structured"]
