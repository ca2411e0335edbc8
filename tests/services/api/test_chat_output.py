"""A chat choice's text as OpenAI's message: reasoning split off first, then tool calls, the rest
content; streamed deltas add up to the whole message, and finish_reason says tool_calls."""
from __future__ import annotations

import json

import pytest

from pdserve.services.api.chat_output import ChatOutput, ChatOutputSpec
from pdserve.services.api.tool_calls import ToolChoice, parse_tools

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
TEXT = ('<think>The user wants weather.</think>Let me check.\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def _streamed(spec: ChatOutputSpec, text: str, step: int) -> tuple[dict, ChatOutput]:
    out = ChatOutput(spec)
    deltas = []
    for i in range(0, len(text), step):
        deltas += out.feed(text[i:i + step])
    deltas += out.finish()
    merged = {"content": "", "reasoning_content": "", "calls": {}}
    for d in deltas:
        merged["content"] += d.get("content", "")
        merged["reasoning_content"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", ()):
            call = merged["calls"].setdefault(c["index"], {"name": "", "arguments": ""})
            call["name"] += c.get("function", {}).get("name", "")
            call["arguments"] += c.get("function", {}).get("arguments", "")
    return merged, out


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_reasoning_then_content_then_a_call_whole_and_streamed(step: int) -> None:
    spec = ChatOutputSpec(TOOLS, ToolChoice("auto"), "hermes", "detect")
    whole = ChatOutput(spec)
    message = whole.message(TEXT)
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Let me check.\n"
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    merged, streamed = _streamed(spec, TEXT, step)
    assert merged["reasoning_content"] == message["reasoning_content"] and merged["content"] == message["content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in merged["calls"].values()] == [("get_weather",
                                                                                           {"city": "Paris"})]
    assert streamed.finish_reason("stop") == "tool_calls"


def test_without_tools_or_reasoning_the_text_is_content_as_it_is() -> None:
    out = ChatOutput(ChatOutputSpec())
    assert out.message(TEXT) == {"role": "assistant", "content": TEXT}
    assert out.finish_reason("stop") == "stop"
    assert ChatOutput(ChatOutputSpec(TOOLS, ToolChoice("none"))).message(TEXT)["content"] == TEXT


def test_a_forced_named_call_is_all_arguments() -> None:
    out = ChatOutput(ChatOutputSpec(TOOLS, ToolChoice("function", "get_weather")))
    message = out.message('{"city": "Oslo"}')
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    required = ChatOutput(ChatOutputSpec(TOOLS, ToolChoice("required"))).message(
        '[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert json.loads(required["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
