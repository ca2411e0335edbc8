"""SpeculativeConfig: vLLM's ``speculative_config`` (a dict in Python, JSON on the command line)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 64   # a draft is verified in one forward: more would only fill the step with rejections


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How decoding sequences speculate, with vLLM's field names.

    ngram: prompt lookup over the sequence's own tokens (engine/spec_decode/ngram.py), its last
    prompt_lookup_max down to prompt_lookup_min tokens matched against earlier ones, the
    num_speculative_tokens after the match proposed.

    suffix: suffix decoding (engine/spec_decode/suffix.py): the sequence's own tokens and the
    outputs of up to suffix_decoding_max_cached_requests earlier requests, indexed to
    suffix_decoding_max_tree_depth tokens; a draft follows the most frequent continuation of the
    longest matching suffix while each token's estimated probability stays at least
    suffix_decoding_min_token_prob, and is at most suffix_decoding_max_spec_factor times the
    match's length (and num_speculative_tokens) long.

    adaptive_depth (pdserve's): each step verifies as many of each sequence's draft tokens as its
    recent acceptance and the step's cost say pay (engine/spec_decode/depth.py), up to
    num_speculative_tokens; a sequence whose drafts are rejected verifies none for a while, so
    text that copies nothing is not slowed. Off: every draft is verified whole."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive_depth: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        for name, high in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", 1 << 16),
                           ("prompt_lookup_min", 1 << 16), ("suffix_decoding_max_tree_depth", 1024),
                           ("suffix_decoding_max_cached_requests", 1 << 20)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"speculative_config.{name} must be an integer in [1, {high}], got {value!r}")
        for name, low, high in (("suffix_decoding_max_spec_factor", 0.0, 64.0),
                                ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"speculative_config.{name} must be a number in [{low}, {high}], got {value!r}")
        if not isinstance(self.adaptive_depth, bool):
            raise ValueError(f"speculative_config.adaptive_depth must be true or false, got {self.adaptive_depth!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict of its fields, or that dict as JSON ("" / "none": None)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if value.strip().lower() in ("", "none", "null"):
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r}: {exc}") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object) of "
                             f"{[f.name for f in dataclasses.fields(cls)]}, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config field(s): {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(names))}")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))
