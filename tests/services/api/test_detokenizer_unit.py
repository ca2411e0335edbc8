"""The incremental detokenizer (services/api/detokenizer.py) and stop strings (its StopMatcher)
on a real tokenizer, without servers: multi-byte characters split over tokens are never split in
the text, the deltas add up to the full decode, stop strings match across token boundaries."""
from __future__ import annotations

import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.services.api.detokenizer import IncrementalDetokenizer, StopMatcher

TEXT = "naïve café — 日本語 🙂 𝕳𝖊𝖑𝖑𝖔 한국어, then plain words at the end"


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: str):
    return load_tokenizer(tiny_qwen3)


def _deltas(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]


def test_a_character_split_over_tokens_comes_out_whole(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    split = [i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i])]
    assert split, "the text should hold a character whose bytes span tokens"
    deltas = _deltas(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)   # nothing emitted half a character
    assert any(deltas[i - 1] == "" for i in split)   # held back until the next token completes it


def test_chunks_of_any_size_give_the_same_text(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for size in (2, 3, 5, len(ids)):
        detok = IncrementalDetokenizer(tokenizer)
        chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
        text = "".join(detok.add(c, final=k == len(chunks) - 1) for k, c in enumerate(chunks))
        assert text == TEXT, size


def test_an_unfinished_character_at_the_end_is_flushed_as_decode_has_it(tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(_deltas(detok, ids[:cut]))
    assert text == tokenizer.decode(ids[:cut])   # final: the held replacement character goes out too


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    special = tokenizer.all_special_ids[0]
    ids = tokenizer.encode("hello", add_special_tokens=False) + [special]
    assert "".join(_deltas(IncrementalDetokenizer(tokenizer), ids)) == "hello"
    kept = "".join(_deltas(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids))
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) and kept != "hello"


def test_ids_past_the_tokenizer_add_no_text(tokenizer) -> None:
    """A model's vocabulary may be larger than its tokenizer's (Qwen3's padding rows; pdserve's
    qwen3-0.6b and llama-3.2-1b presets have 8192 tokenizer ids for 151936 / 128256 model ids):
    such ids decode to nothing, in the stream and in a logprobs entry's token text."""
    from pdserve.services.api.prompt_scores import token_text as _token_text

    past = [len(tokenizer), len(tokenizer) + 1, 151_935]
    ids = tokenizer.encode("hello", add_special_tokens=False)
    mixed = [past[0], *ids[:1], past[1], *ids[1:], past[2]]
    for skip in (True, False):
        assert "".join(_deltas(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), mixed)) == "hello"
    assert [_token_text(tokenizer, t) for t in past] == ["", "", ""]


def _stream_with_stop(tokenizer, ids: list[int], stops: list[str], min_tokens: int = 0) -> tuple[str, bool, int]:
    """(text sent, whether a stop string ended it, tokens read), as the HTTP API streams a choice."""
    detok, matcher, out = IncrementalDetokenizer(tokenizer), StopMatcher(stops), []
    for n, t in enumerate(ids, 1):
        final = n == len(ids)
        text, hit = matcher.add(detok.add([t], final=final), final, check=n >= min_tokens)
        out.append(text)
        if hit:
            return "".join(out), True, n
    return "".join(out), False, len(ids)


def test_a_stop_string_across_token_boundaries(tokenizer) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]   # the end of one token and the start of the next
    start = text.index(stop)
    sent, hit, read = _stream_with_stop(tokenizer, ids, [stop])
    assert hit and sent == text[:start]   # nothing of the stop string, nothing after it
    assert read == k + 2                  # found with the token that completed it


def test_a_stop_string_inside_a_multibyte_run_and_min_tokens(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    sent, hit, _ = _stream_with_stop(tokenizer, ids, ["𝖑𝖑"])
    assert hit and sent == TEXT[:TEXT.index("𝖑𝖑")]
    sent, hit, _ = _stream_with_stop(tokenizer, ids, ["naï"], min_tokens=len(ids))   # too early: not a stop
    assert not hit and sent == TEXT
    sent, hit, _ = _stream_with_stop(tokenizer, ids, ["not in it"])
    assert not hit and sent == TEXT       # what was held back as a possible start is sent at the end
