"""A request's constraint compiled for one vocabulary, and checked without one.

Each kind of StructuredOutputsParams maps to one xgrammar grammar: a JSON schema (strict as
OpenAI's ``strict``: no properties beyond the schema's), any JSON object (``json_object``), a
regex, a choice (an EBNF alternation of the strings, escaped as JSON strings), an EBNF grammar.
``check_structured`` parses the constraint without a tokenizer (the router, before anything is
queued); ``Grammars.compile`` adds the vocabulary's token-mask cache (the workers), cached by
xgrammar per (kind, text) up to CACHE_BYTES. Sizes are bounded by SamplingParams' validation
before either runs; both run off the event loop, under a deadline, in their callers.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

import torch

from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.engine.structured import bitmask
from pdserve.engine.structured.constraints import StructuredError, choice_ebnf, field_name, reason
from pdserve.engine.structured.state import GrammarState
from pdserve.engine.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import xgrammar

JSON_KINDS = ("json", "json_object")
CACHE_BYTES = 256 << 20     # compiled grammars kept per engine (xgrammar's own cache)
COMPILE_THREADS = 1         # one core's worth: a compile must not take the engine thread's core too


def special_tokens_cleared(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """A bitmask row allowing every token but the tokenizer's special ones (<|im_start|>, a
    template's <tool_call> or <think>...) other than the stop tokens: xgrammar reads a special
    token as its text, so a JSON string could otherwise hold one."""
    keep = bitmask.allocate(1, vocab_size)
    stops = set(stop_token_ids)
    special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    special |= set(getattr(tokenizer, "all_special_ids", ()))
    for tok in sorted(special - stops):
        if 0 <= tok < vocab_size:
            _clear(keep, tok)
    return keep


def control_tokens_cleared(decoded_vocab: Sequence[bytes], vocab_size: int,
                           stop_token_ids: Sequence[int]) -> torch.Tensor:
    """A bitmask row allowing every token but those holding a control character (bytes 0x00 to
    0x1f), the stop tokens aside. Compact JSON (any_whitespace=False) never holds one, but
    xgrammar's strings with a maxLength allow them (its bounded-string rule is [^"\\\r\n]), and a
    raw control character in a string is not JSON."""
    keep = bitmask.allocate(1, vocab_size)
    stops = set(stop_token_ids)
    for tok, text in enumerate(decoded_vocab[:vocab_size]):
        if tok not in stops and any(b < 0x20 for b in text):
            _clear(keep, tok)
    return keep


def _clear(row: torch.Tensor, tok: int) -> None:
    row[0, tok // 32] &= ~(1 << (tok % 32)) if tok % 32 != 31 else 0x7FFFFFFF


class Grammars:
    """Compiles constraints for one model's vocabulary. The tokenizer is read on first use (an
    engine that never sees a constraint never loads it). Thread-safe."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: "xgrammar.GrammarCompiler | None" = None
        self._keep: torch.Tensor | None = None        # every token but the special ones
        self._keep_json: torch.Tensor | None = None   # ... and but those with a control character
        self._lock = threading.Lock()

    def _get_compiler(self) -> "xgrammar.GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tokenizer = load_tokenizer(self.tokenizer_dir)   # read only by an engine that sees a constraint
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._keep = special_tokens_cleared(tokenizer, self.vocab_size, self.stop_token_ids)
                self._keep_json = self._keep & control_tokens_cleared(info.decoded_vocab, self.vocab_size,
                                                                      self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=True,
                                                     cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def state(self, spec: StructuredOutputsParams, tokens: Sequence[int] = ()) -> GrammarState:
        """A matcher for spec, past tokens (a sequence's output so far): GrammarState.following."""
        compiled = self.compile(spec)
        return GrammarState.following(compiled, tokens, self._keep_json if spec.kind()[0] in JSON_KINDS else self._keep)

    def compile(self, spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """The compiled constraint (from xgrammar's cache when seen before); StructuredError if it
        does not compile."""
        compiler = self._get_compiler()
        kind, text = spec.kind()
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(spec.choice))
            return compiler.compile_grammar(text)
        except Exception as exc:  # noqa: BLE001
            raise StructuredError(f"{field_name(kind)} does not compile: {reason(exc)}") from None
