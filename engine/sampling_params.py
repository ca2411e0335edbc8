"""Per-request sampling parameters and their validation."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from pdserve.engine.quoting import quoted

MAX_LOGPROBS = 20   # vLLM's default max_logprobs
MAX_TOP_K = 2**31 - 1        # the wire's bounds (common.proto: top_k int32, token counts uint32)
MAX_TOKENS = 2**32 - 1
MAX_CACHE_SALT_CHARS = 256
PRIORITY_RANGE = (-(2**31), 2**31 - 1)   # the wire's int32 (common.proto: priority)
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38   # smaller (subnormal) reads as 0 in a process that flushes denormals
PENALTY_RANGE = (-2.0, 2.0)      # presence_penalty, frequency_penalty (OpenAI's)
MAX_REPETITION_PENALTY = 10.0    # repetition_penalty in (0, this]
LOGIT_BIAS_RANGE = (-100.0, 100.0)   # OpenAI's
MAX_LOGIT_BIAS = 1024            # entries of logit_bias
MAX_BAD_WORDS = 128              # token sequences in bad_words_token_ids (a word: two, with and without a space)
MAX_BAD_WORD_TOKENS = 32         # tokens in one of them
MAX_STRUCTURED_BYTES = 64 << 10  # a JSON schema, grammar or regex (UTF-8), or all choices together
MAX_CHOICES = 256


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's structured_outputs): exactly one of them.

    json: a JSON schema (its JSON text); json_object: any JSON object; regex; choice: one of
    these strings; grammar: an EBNF (GBNF) grammar. engine/structured compiles it.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):   # as vLLM takes it: the schema itself
            self.json = json.dumps(self.json, separators=(",", ":"), ensure_ascii=False)

    def kind(self) -> tuple[str, str]:
        """(which constraint, its text): the compiled grammar's cache key."""
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                return name, value
        if self.choice is not None:
            return "choice", "\x00".join(self.choice)
        return "json_object", ""

    def validate(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        name = given[0]
        if name == "choice":
            if not isinstance(self.choice, list) or not 0 < len(self.choice) <= MAX_CHOICES or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be 1 to {MAX_CHOICES} non-empty strings")
            size = sum(len(c.encode("utf-8", "surrogatepass")) for c in self.choice)
        elif name != "json_object":
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {quoted(value)}")
            size = len(value.encode("utf-8", "surrogatepass"))
        else:
            size = 0
        if size > MAX_STRUCTURED_BYTES:
            raise ValueError(f"structured_outputs.{name} is {size} bytes, more than {MAX_STRUCTURED_BYTES}")


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature == 0 means greedy. top_k == 0 disables top-k; top_p == 1 disables top-p.
    A request with a seed samples reproducibly, whatever else shares its batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0          # EOS and stop_token_ids do not end the request before this many tokens
    logprobs: int | None = None  # report the sampled token's logprob and this many top alternatives
    # report each prompt token's logprob (after the first) and this many top alternatives (vLLM's);
    # such a prompt is computed in full where it is prefilled: the prefix cache serves none of it
    prompt_logprobs: int | None = None
    cache_salt: str | None = None  # prefix-cache namespace: blocks are shared only within one salt
    priority: int = 0            # lower is served first (vLLM's); a higher class may preempt a lower one
    # Logits processing (engine/layers/logits_processors.py), vLLM's semantics: presence and
    # frequency penalties count output tokens, the repetition penalty prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0           # tokens less likely than min_p x the most likely one are left out
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit
    bad_words_token_ids: list[list[int]] | None = None   # never emit these token sequences
    structured_outputs: StructuredOutputsParams | None = None   # a grammar the output must follow

    def validate(self) -> None:
        """Raise ValueError naming the first field outside its limits."""
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {quoted(self.temperature)}")
        if not isinstance(self.top_p, (int, float)) or not (FLOAT32_MIN_NORMAL <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (and a normal float32: >= {FLOAT32_MIN_NORMAL:.4g}), "
                             f"got {quoted(self.top_p)}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 disables it), got {quoted(self.top_k)}")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {quoted(self.max_tokens)}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0 or self.seed >= 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {quoted(self.seed)}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {quoted(self.min_tokens)}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {quoted(self.logprobs)}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, "
                             f"got {quoted(self.prompt_logprobs)}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt.isprintable()
                                            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a non-empty printable string of at most {MAX_CACHE_SALT_CHARS} "
                             f"characters")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or \
                not PRIORITY_RANGE[0] <= self.priority <= PRIORITY_RANGE[1]:
            raise ValueError(f"priority must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], "
                             f"got {quoted(self.priority)}")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {quoted(tok)}")
        self._validate_processing()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], got {quoted(value)}")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], "
                             f"got {quoted(self.repetition_penalty)}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {quoted(self.min_p)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {quoted(tok)}")
                if not _number(bias) or not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                    raise ValueError(f"logit_bias values must be in [{LOGIT_BIAS_RANGE[0]}, {LOGIT_BIAS_RANGE[1]}], "
                                     f"got {quoted(bias)}")
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words must hold at most {MAX_BAD_WORDS} words")
            for word in words:
                if not isinstance(word, list) or not 0 < len(word) <= MAX_BAD_WORD_TOKENS or \
                        not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in word):
                    raise ValueError(f"bad_words: each word must be 1 to {MAX_BAD_WORD_TOKENS} tokens, "
                                     f"got {quoted(word)}")

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature, top-k/p and min-p changes this request's logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or bool(self.bad_words_token_ids) or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
