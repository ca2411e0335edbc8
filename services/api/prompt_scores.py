"""A prompt's log-probabilities in the OpenAI API's two shapes: completions' ``echo`` with
``logprobs`` (the prompt's tokens lead the choice's logprobs object, the first with no logprob,
as OpenAI's legacy API and lm-evaluation-harness's ``local-completions`` read them), and vLLM's
``prompt_logprobs`` (one entry per prompt token, the first None, each mapping token ids to their
logprob, rank and text). The workers report them per prompt token after the first
(common.proto TokenLogprob, engine/logprobs.py)."""
from __future__ import annotations

from typing import Any, Sequence


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def echo_logprobs(tokenizer, prompt: Sequence[int], scores: Sequence, top: int) -> dict[str, list]:
    """The prompt's part of a completions logprobs object: {tokens, token_logprobs, top_logprobs,
    text_offset}, offsets from 0; the first token has None for its logprob and alternatives.
    scores: one TokenLogprob per prompt token after the first; top: alternatives per token."""
    tokens = [token_text(tokenizer, t) for t in prompt]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    logprobs: list[float | None] = [None]
    alternatives: list[dict[str, float] | None] = [None]
    for text, lp in zip(tokens[1:], scores):
        logprobs.append(lp.logprob)
        shown = {token_text(tokenizer, i): v for i, v in zip(lp.top_token_ids[:top], lp.top_logprobs[:top])}
        shown.setdefault(text, lp.logprob)
        alternatives.append(shown)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": alternatives, "text_offset": offsets}


def joined(prompt_part: dict[str, list], output_part: dict[str, list] | None) -> dict[str, list]:
    """The prompt's logprobs object followed by the output's (whose text_offset starts where the
    prompt's text ends)."""
    if output_part is None:
        return prompt_part
    return {key: prompt_part[key] + output_part[key] for key in prompt_part}


def text_length(part: dict[str, list]) -> int:
    return sum(len(t) for t in part["tokens"])


def vllm_prompt_logprobs(tokenizer, prompt: Sequence[int], scores: Sequence, top: int) -> list[Any]:
    """vLLM's prompt_logprobs: None for the first token, then per token {token id (a string, as
    JSON keys are): {"logprob", "rank", "decoded_token"}} for the token itself and its top
    alternatives."""
    out: list[Any] = [None]
    for token_id, lp in zip(prompt[1:], scores):
        entry = {str(i): {"logprob": v, "rank": rank, "decoded_token": token_text(tokenizer, i)}
                 for rank, (i, v) in enumerate(zip(lp.top_token_ids[:top], lp.top_logprobs[:top]), start=1)}
        entry.setdefault(str(token_id), {"logprob": lp.logprob, "rank": lp.rank,
                                         "decoded_token": token_text(tokenizer, token_id)})
        out.append(entry)
    return out
