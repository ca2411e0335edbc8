"""Request validation shared by the engine and the router (which holds no model)."""
from __future__ import annotations

from pdserve.engine.quoting import quoted
from pdserve.engine.sampling_params import SamplingParams


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     output_token_ids: list[int] | None = None) -> None:
    """Raise ValueError naming the field and its limit. output_token_ids: tokens the request
    already generated (a migrated request); they count towards max_tokens."""
    params.validate()
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    bad_words = [t for word in params.bad_words_token_ids or () for t in word]
    for name, ids in (("prompt", prompt_token_ids), ("output", output_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                      ("bad_words", bad_words)):
        for tok in ids:
            if not isinstance(tok, int) or not 0 <= tok < vocab_size:
                raise ValueError(f"{name} token id {quoted(tok)} is outside the vocabulary [0, {vocab_size})")
    if output_token_ids and len(output_token_ids) >= params.max_tokens:
        raise ValueError(f"output_token_ids ({len(output_token_ids)}) must be fewer than max_tokens ({params.max_tokens})")
    if params.max_tokens >= max_model_len:   # too many whatever the prompt: the field to change is max_tokens
        raise ValueError(f"max_tokens ({params.max_tokens}) must be below max_model_len ({max_model_len}), "
                         f"leaving room for the prompt")
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(f"prompt tokens ({len(prompt_token_ids)}) + max_tokens ({params.max_tokens}) = {total} "
                         f"exceeds max_model_len ({max_model_len})")
