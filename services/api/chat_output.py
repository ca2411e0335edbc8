"""A chat choice's text as OpenAI's assistant message: ``reasoning_content`` split off by the
reasoning parser (a thinking template), then ``tool_calls`` found by the tool parser (the
request's tools: the template's format under tool_choice "auto", the forced JSON under
"required" or a named function), the rest ``content``; whole (``message``) or streamed as
chat-completion deltas (``feed`` ... ``finish``), the same parsers either way."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.services.api.reasoning import StreamingReasoningParser
from pdserve.services.api.tool_calls import Tool, ToolChoice
from pdserve.services.api.tool_parsers import StreamingToolParser, guided_parser, tool_parser


@dataclass(slots=True)
class ChatOutputSpec:
    """What a chat request's output is parsed for: its tools, the tool choice, the auto parser's
    format (services/api/tool_parsers.py TOOL_PARSERS), how reasoning starts (None: no reasoning)."""

    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    tool_format: str = "hermes"
    reasoning_start: str | None = None


class ChatOutput:
    """One choice's parsers. A forced call's output is all tool call (a named function's: its
    arguments); an auto one's, content and the calls the model wrote."""

    def __init__(self, spec: ChatOutputSpec) -> None:
        self.reasoning = StreamingReasoningParser(spec.reasoning_start) if spec.reasoning_start else None
        mode = spec.tool_choice.mode
        self.tools: StreamingToolParser | None = (
            guided_parser(spec.tools, spec.tool_choice) if mode in ("required", "function")
            else tool_parser(spec.tool_format) if mode == "auto" and spec.tools else None)
        self.made_calls = False

    def feed(self, text: str) -> list[dict]:
        """Deltas for the next piece of text ({"reasoning_content"}, {"content"}, {"tool_calls"})."""
        parts = self.reasoning.feed(text) if self.reasoning is not None else [{"content": text}] if text else []
        return self._through_tools(parts, final=False)

    def finish(self) -> list[dict]:
        """What was held back (a possible tag's start, an unclosed call), at the end."""
        parts = self.reasoning.finish() if self.reasoning is not None else []
        return self._through_tools(parts, final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called a tool and stopped by itself."""
        return "tool_calls" if self.made_calls and reason == "stop" else reason

    def _through_tools(self, parts: list[dict], final: bool) -> list[dict]:
        if self.tools is None:
            return parts
        out: list[dict] = []
        for part in parts:
            out += self.tools.feed(part["content"]) if "content" in part else [part]
        if final:
            out += self.tools.finish()
        if any("tool_calls" in d for d in out):
            self.made_calls = True
        return out

    def message(self, text: str) -> dict:
        """The whole assistant message of text: content (None when there is none but calls),
        reasoning_content when the template thinks, tool_calls when any."""
        deltas = self.feed(text) + self.finish()
        content = "".join(d.get("content", "") for d in deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        calls: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls", ()):
                call = calls.setdefault(c["index"], {"id": c.get("id"), "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                fn = c.get("function", {})
                call["function"]["name"] += fn.get("name", "")
                call["function"]["arguments"] += fn.get("arguments", "")
                if c.get("id"):
                    call["id"] = c["id"]
        message: dict = {"role": "assistant", "content": content or (None if calls else "")}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return message
