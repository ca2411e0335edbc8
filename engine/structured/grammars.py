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

import json
import re
import threading
from typing import TYPE_CHECKING, Sequence

import torch

from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.engine.structured import bitmask
from pdserve.engine.structured.state import GrammarState

if TYPE_CHECKING:
    import xgrammar

JSON_KINDS = ("json", "json_object")
COMPILE_TIMEOUT_S = 10.0    # a caller waits this long for a check or a compile, then refuses the request
CACHE_BYTES = 256 << 20     # compiled grammars kept per engine (xgrammar's own cache)
COMPILE_THREADS = 1         # one core's worth: a compile must not take the engine thread's core too
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")   # xgrammar's "[17:02:27] /project/cpp/x.cc:94: " prefix


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


class StructuredError(ValueError):
    """A constraint that does not compile; the message names the field (structured_outputs.KIND)."""


def _field(kind: str) -> str:
    return f"structured_outputs.{kind}"


def _message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOCATION.sub("", text)[:200]


def choice_ebnf(choices: Sequence[str]) -> str:
    """root ::= "a" | "b" ...: each choice as an EBNF string literal (JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(spec: StructuredOutputsParams) -> "xgrammar.Grammar":
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
            raise StructuredError(f"{_field(kind)} is not valid JSON: {exc.msg} at {exc.pos}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredError(f"{_field(kind)} must be a JSON schema (an object)")
    try:
        _grammar(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError (or ValueError) with the reason
        raise StructuredError(f"{_field(kind)} does not compile: {_message(exc)}") from None


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

                # transformers: loaded only by an engine that sees a constraint
                from pdserve.engine.tokenizer import load_tokenizer
                tokenizer = load_tokenizer(self.tokenizer_dir)
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
            raise StructuredError(f"{_field(kind)} does not compile: {_message(exc)}") from None
