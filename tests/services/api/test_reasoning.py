"""Reasoning content (services/api/reasoning.py): <think>...</think> split from the answer as
vLLM's qwen3 parser, the start chosen by the prompt, and streaming adding up to the whole-output
result on every split."""
from __future__ import annotations

import random

import pytest

from pdserve.services.api.reasoning import (
    StreamingReasoningParser, extract_reasoning, reasoning_parser_for, start_for_prompt)


def test_think_tags_split_reasoning_from_content() -> None:
    text = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."
    assert extract_reasoning(text) == ("\nThe user wants 2+2. That is 4.\n", "\n\nThe answer is 4.")
    # the template put <think> in the prompt: the output starts inside thinking (vLLM's qwen3)
    assert extract_reasoning("Hmm, 4.</think>It is 4.") == ("Hmm, 4.", "It is 4.")
    # no </think>: cut short while thinking, all reasoning (vLLM's qwen3 with thinking on)
    assert extract_reasoning("<think>Let me see") == ("Let me see", None)
    assert extract_reasoning("Let me see") == ("Let me see", None)
    assert extract_reasoning("<think>all</think>") == ("all", None)
    assert extract_reasoning("<think></think>Hi") == (None, "Hi")
    assert extract_reasoning("") == (None, None)
    # only the first <think> is a tag; later tags and stray brackets are text
    assert extract_reasoning("<think>a <think> b < c </thin</think>x </think> y") == ("a <think> b < c </thin",
                                                                                      "x </think> y")


def test_the_start_follows_the_prompt() -> None:
    assert start_for_prompt(None) == "thinking"
    assert start_for_prompt("<|im_start|>assistant\n<think>\n") == "thinking"
    assert start_for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"
    assert start_for_prompt("<|im_start|>assistant\n") == "detect"
    assert start_for_prompt("<|im_start|>assistant\n<think>\n", enable_thinking=False) == "content"
    assert extract_reasoning("<think>x</think>y", "content") == (None, "<think>x</think>y")
    assert extract_reasoning("\n<think>x</think>y", "detect") == ("x", "y")
    assert extract_reasoning("Paris.</think>", "detect") == (None, "Paris.</think>")
    assert extract_reasoning("  <thi", "detect") == (None, "  <thi")
    assert extract_reasoning("  ", "detect") == (None, "  ")


def test_the_parser_is_chosen_by_template() -> None:
    assert reasoning_parser_for("{%- if enable_thinking is false %}<think>\n\n</think>{% endif %}", "qwen3") == "qwen3"
    assert reasoning_parser_for("<|im_start|>{{ message.content }}", "qwen2") is None
    assert reasoning_parser_for(None, None) is None


def test_streaming_holds_back_only_a_possible_tag() -> None:
    parser = StreamingReasoningParser()
    assert parser.feed("<thi") == []
    assert parser.feed("nk>Let") == [{"reasoning_content": "Let"}]
    assert parser.feed(" me </th") == [{"reasoning_content": " me "}]
    assert parser.feed("ink>\n\nIt") == [{"content": "\n\nIt"}]
    assert parser.feed(" is </think>") == [{"content": " is </think>"}]
    assert parser.finish() == []
    parser = StreamingReasoningParser()
    assert parser.feed("a <b") == [{"reasoning_content": "a <b"}]
    assert parser.feed(" <") == [{"reasoning_content": " "}]
    assert parser.finish() == [{"reasoning_content": "<"}]


TEXTS = [
    "<think>\nThe user asks for the weather. I should call get_weather.\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "Okay, </thinking> is not the tag. <think> neither, now.</think>Answer: <b>4</b>",
    "<think>unterminated < thought </thin",
    "  \n<think>x</think>",
    "no tags at all",
    "</think>",
    "Zürich ☃ </think> ☀",
]


def _assemble(deltas: list[dict]) -> tuple[str | None, str | None]:
    reasoning = content = ""
    for d in deltas:
        assert len(d) == 1 and next(iter(d.values()))
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
    return reasoning or None, content or None


def _stream(start: str, pieces: list[str]) -> list[dict]:
    parser = StreamingReasoningParser(start)
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    return deltas + parser.finish()


@pytest.mark.parametrize("start", ["thinking", "detect", "content"])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_adds_up_to_the_whole_output(text: str, start: str) -> None:
    expected = extract_reasoning(text, start)
    assert _assemble(_stream(start, [text])) == expected
    assert _assemble(_stream(start, list(text))) == expected
    for i in range(len(text) + 1):
        assert _assemble(_stream(start, [text[:i], text[i:]])) == expected, i
    rng = random.Random(7)
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 10))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _assemble(_stream(start, pieces)) == expected, pieces
