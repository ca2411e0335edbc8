"""Tool calls in a model's output, whole or streamed: parsers for its free output (tool_choice
"auto") and for output forced by a schema ("required", a named function).

* hermes output (Qwen2.5, Qwen3, Hermes): text, then calls, each
  ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``.
* llama3_json output (Llama 3.x): ``[<|python_tag|>]{"name": N, "parameters": {...}}`` (or
  ``"arguments"``), several separated by ``;``.

Streaming and whole outputs are parsed by the same state machine (``extract`` feeds the whole
text at once), so what a stream's deltas add up to is what ``extract`` returns, however the text
is split. A call is emitted once its closing tag (or JSON end) is seen and it parses; a block
that does not parse stays in the content, verbatim. Once a call has been found, text between or
after calls that is only whitespace is dropped (the newlines between ``</tool_call>`` and the
next ``<tool_call>``).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from pdserve.services.api.stream_text import partial_suffix
from pdserve.services.api.tool_calls import Tool, ToolChoice

WHITESPACE = " \t\r\n"   # JSON's


# ---- tool calls ---------------------------------------------------------------------------------

def new_call_id() -> str:
    """OpenAI's shape: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCall:
    """One call the model made: arguments is a JSON text (an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


def to_openai(call: ToolCall, index: int | None = None) -> dict:
    """The call as an assistant message's ``tool_calls`` entry (with ``index``: a stream's)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update(id=call.id, type="function", function={"name": call.name, "arguments": call.arguments})
    return out


def _call_of(obj: Any, arg_keys: tuple[str, ...]) -> ToolCall | None:
    """obj as a call: a JSON object with a non-empty string "name" and its arguments an object
    under the first of arg_keys present (absent: {}); None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class _JsonEnd:
    """Where a JSON object or array ends, fed piece by piece: brackets are counted outside strings
    (escapes followed), nothing else is checked (json.loads judges the text it delimits). The
    first character fed is the opening bracket."""

    _OUTSIDE = re.compile(r'[{}\[\]"]')
    _INSIDE = re.compile(r'["\\]')

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape = 0, False, False

    def feed(self, text: str) -> int | None:
        """Index in text just past the closing bracket, or None when not seen yet."""
        i = 0
        while i < len(text):
            if self.in_string:
                if self.escape:
                    self.escape, i = False, i + 1
                    continue
                m = self._INSIDE.search(text, i)
                if m is None:
                    return None
                i = m.end()
                if m.group() == '"':
                    self.in_string = False
                else:
                    self.escape = True
            else:
                m = self._OUTSIDE.search(text, i)
                if m is None:
                    return None
                i, c = m.end(), m.group()
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    if self.depth <= 0:
                        return i
        return None


class StreamingToolParser:
    """Finds tool calls in one output, streamed (``feed`` each new piece of text, then
    ``finish``) or whole (``extract``); one instance per output. ``feed``/``finish`` return
    OpenAI chat-completion delta dicts in order: ``{"content": text}`` for text that is certainly
    not part of a call, and per call ``{"tool_calls": [{"index": i, "id": ID, "type": "function",
    "function": {"name": N, "arguments": ""}}]}`` then ``{"tool_calls": [{"index": i, "function":
    {"arguments": ARGS}}]}``. Never raises on the model's text."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._content: list[str] = []
        self._out: list[dict] = []
        self._held_ws = ""            # whitespace of the current segment, before any other text
        self._segment_has_text = False

    def feed(self, delta: str) -> list[dict]:
        if delta:
            self._step(delta, final=False)
        return self._take()

    def finish(self) -> list[dict]:
        self._step("", final=True)
        if self._held_ws and not self.calls:
            self._emit_text_now(self._held_ws)
        self._held_ws = ""
        return self._take()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a whole output."""
        self.feed(text)
        self.finish()
        return "".join(self._content) or None, list(self.calls)

    # -- for the formats --
    def _step(self, delta: str, final: bool) -> None:
        raise NotImplementedError

    def _text(self, text: str) -> None:
        """Text of the output that is content; whitespace before a segment's first other text is
        held (dropped if the segment ends at a call, or at the end once a call was found)."""
        if not text:
            return
        if self._segment_has_text:
            self._emit_text_now(text)
        elif text.strip(WHITESPACE):
            self._emit_text_now(self._held_ws + text)
            self._held_ws, self._segment_has_text = "", True
        else:
            self._held_ws += text

    def _call(self, call: ToolCall) -> None:
        self._held_ws, self._segment_has_text = "", False
        index = len(self.calls)
        self.calls.append(call)
        self._out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                          "function": {"name": call.name, "arguments": ""}}]})
        self._out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})

    def _emit_text_now(self, text: str) -> None:
        self._content.append(text)
        if self._out and "content" in self._out[-1]:
            self._out[-1] = {"content": self._out[-1]["content"] + text}
        else:
            self._out.append({"content": text})

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out


class HermesToolParser(StreamingToolParser):
    """hermes: ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` blocks (whitespace
    around the JSON allowed) amid text. A block ends at the ``</tool_call>`` after its JSON object
    (so a string holding "</tool_call>" or "}" does not end it), else at the first
    ``</tool_call>``; at the end of the output an unclosed block is a call if what follows its tag
    parses (as vLLM). A block that is not a call stays in the content, tags and all."""

    START, END = "<tool_call>", "</tool_call>"
    ARG_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""                # outside a call: text not yet emitted; inside: the block's body
        self._in_call = False
        self._phase = "lead"          # in a call: lead, json, after, plain
        self._pos = 0                 # how far the phase has looked into _buf
        self._json_start = self._json_end = 0
        self._scan: _JsonEnd | None = None

    def _step(self, delta: str, final: bool) -> None:
        self._buf += delta
        while True:
            if not self._in_call:
                k = self._buf.find(self.START)
                if k < 0:
                    keep = 0 if final else partial_suffix(self._buf, (self.START,))
                    self._text(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._text(self._buf[:k])
                self._buf = self._buf[k + len(self.START):]
                self._in_call, self._phase, self._pos = True, "lead", 0
            end = self._block_end(final)
            if end is None:
                if not final:
                    return
                self._close_block(self._buf, closed=False)   # unclosed at the end of the output
                self._buf = ""
                return
            body_end, after = end
            self._close_block(self._buf[:body_end], closed=True)
            self._buf = self._buf[after:]

    def _block_end(self, final: bool) -> tuple[int, int] | None:
        """(end of the body, end of the closing tag) in _buf, or None: not known yet (or, when
        final, no closing tag at all)."""
        buf = self._buf
        if self._phase == "lead":
            i = self._pos
            while i < len(buf) and buf[i] in WHITESPACE:
                i += 1
            self._pos = i
            if i == len(buf) and not final:
                return None
            if i < len(buf) and buf[i] == "{":
                self._phase, self._json_start, self._scan = "json", i, _JsonEnd()
            else:
                self._phase, self._pos = "plain", 0
        if self._phase == "json":
            found = self._scan.feed(buf[self._pos:]) if self._pos < len(buf) else None
            if found is None:
                self._pos = len(buf)
                if not final:
                    return None
                self._phase, self._pos = "plain", 0
            else:
                self._json_end = self._pos = self._pos + found
                self._phase = "after"
        if self._phase == "after":
            i = self._pos
            while i < len(buf) and buf[i] in WHITESPACE:
                i += 1
            rest = buf[i:]
            if rest.startswith(self.END):
                return self._json_end, i + len(self.END)
            if self.END.startswith(rest) and not final:
                return None
            self._phase, self._pos = "plain", 0
        k = buf.find(self.END, self._pos)
        if k < 0:
            self._pos = max(0, len(buf) - len(self.END) + 1)
            return None
        return k, k + len(self.END)

    def _close_block(self, body: str, closed: bool) -> None:
        self._in_call = False
        call = _call_of(json_or_none(body.strip(WHITESPACE)), self.ARG_KEYS)
        if call is not None:
            self._call(call)
        else:
            self._text(self.START + body + (self.END if closed else ""))


class _JsonCallSequence(StreamingToolParser):
    """An output that is nothing but JSON call objects in sequence: an optional TAG, an OPEN
    bracket if the format has one, objects separated by SEP, a CLOSE bracket. Each object that is
    a call is emitted as its end is seen; when the output does not start so (or its first object is
    no call), the whole output is content, verbatim; after calls, the first thing that does not fit
    starts content that runs to the end (the text after the last call, verbatim)."""

    TAG: str | None = None
    OPEN: str | None = None
    SEP = ";"
    CLOSE: str | None = None
    ARG_KEYS: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""            # text since the start, or since the last call's end
        self._pos = 0
        self._phase = "lead"      # lead, item, object, sep, closed, text
        self._tag_seen = False
        self._scan: _JsonEnd | None = None
        self._obj_start = 0

    def _fail(self) -> None:
        self._phase = "text"
        self._text(self._buf)
        self._buf = ""

    def _skip_ws(self) -> bool:
        """Past whitespace; False when the buffer ends first."""
        while self._pos < len(self._buf) and self._buf[self._pos] in WHITESPACE:
            self._pos += 1
        return self._pos < len(self._buf)

    def _step(self, delta: str, final: bool) -> None:
        if self._phase == "text":
            self._text(delta)
            return
        self._buf += delta
        while self._phase != "text":
            buf = self._buf
            if self._phase in ("lead", "item"):
                if not self._skip_ws():
                    break
                rest = buf[self._pos:]
                if self._phase == "lead" and self.TAG and not self._tag_seen:
                    if rest.startswith(self.TAG):
                        self._pos, self._tag_seen = self._pos + len(self.TAG), True
                        continue
                    if self.TAG.startswith(rest) and not final:
                        break
                if self._phase == "lead" and self.OPEN:
                    if rest[0] != self.OPEN:
                        self._fail()
                        break
                    self._pos, self._phase = self._pos + 1, "item"
                    continue
                if rest[0] != "{":
                    self._fail()
                    break
                self._phase, self._obj_start, self._scan = "object", self._pos, _JsonEnd()
            elif self._phase == "object":
                found = self._scan.feed(buf[self._pos:])
                if found is None:
                    self._pos = len(buf)
                    break
                end = self._pos + found
                call = _call_of(json_or_none(buf[self._obj_start:end]), self.ARG_KEYS)
                if call is None:
                    self._fail()
                    break
                self._call(call)
                self._buf, self._pos, self._phase = buf[end:], 0, "sep"
            elif self._phase == "sep":
                if not self._skip_ws():
                    break
                c = buf[self._pos]
                if c == self.SEP:
                    self._pos, self._phase = self._pos + 1, "item"
                elif c == self.CLOSE:
                    self._pos, self._phase = self._pos + 1, "closed"
                else:
                    self._fail()
            else:   # closed
                if self._skip_ws():
                    self._fail()
                break
        if final and self._phase != "text":
            if self.calls and self._phase != "object":
                self._buf = ""          # separators and whitespace after the last call
            else:
                self._fail()            # no call, or a truncated object: content, verbatim


class Llama3JsonToolParser(_JsonCallSequence):
    """llama3_json: the output, after optional whitespace and ``<|python_tag|>``, is
    ``{"name": N, "parameters": {...}}`` (or "arguments"), several separated by ";". An output
    that starts otherwise is content (vLLM's streaming rule; its whole-output parser also looks for
    JSON amid text)."""

    TAG = "<|python_tag|>"


class _RequiredToolParser(_JsonCallSequence):
    """tool_choice "required": the guided output ``[{"name": N, "parameters": {...}}, ...]``."""

    OPEN, SEP, CLOSE = "[", ",", "]"
    ARG_KEYS = ("parameters",)


class _NamedToolParser(StreamingToolParser):
    """A named tool_choice: the whole guided output is the arguments of one call to name
    (vLLM: the text as it is; here without the whitespace around it)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._call_obj = ToolCall(name, "")
        self._started = False
        self._held = ""           # whitespace that may be the end of the output

    def _step(self, delta: str, final: bool) -> None:
        if not self._started:
            delta = delta.lstrip(WHITESPACE)
            if not delta and not final:
                return
            self._started = True
            self._call(self._call_obj)
            self._out.pop()       # the empty arguments fragment: fragments follow
        text = self._held + delta
        body = text.rstrip(WHITESPACE)
        self._held = "" if final else text[len(body):]
        if body:
            self._call_obj.arguments += body
            self._out.append({"tool_calls": [{"index": 0, "function": {"arguments": body}}]})


TOOL_PARSERS: dict[str, type[StreamingToolParser]] = {"hermes": HermesToolParser,
                                                       "llama3_json": Llama3JsonToolParser}


def tool_parser(name: str) -> StreamingToolParser:
    """A fresh parser for "auto" output by its name (TOOL_PARSERS)."""
    return TOOL_PARSERS[name]()


def extract_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole "auto" output."""
    return tool_parser(parser).extract(text)


def guided_parser(tools: list[Tool], choice: ToolChoice) -> StreamingToolParser:
    """The parser of output forced by guided_schema(tools, choice): "required" or a named function."""
    if choice.mode == "function":
        return _NamedToolParser(choice.name)
    if choice.mode == "required":
        return _RequiredToolParser()
    raise ValueError(f"tool_choice {choice.mode} has no guided output")


def calls_from_guided_output(text: str, tools: list[Tool], choice: ToolChoice) -> list[ToolCall]:
    """The calls in a whole guided output (guided_parser(...).extract(text) also gives content:
    what does not parse, e.g. an array cut short by max_tokens after its last complete call)."""
    return guided_parser(tools, choice).extract(text)[1]


def parser_for_template(chat_template: str | None, model_type: str | None = None) -> str:
    """llama3_json for Llama 3.1+ templates (they mention <|python_tag|> or "Environment:
    ipython"), hermes otherwise (Qwen2.5/3, Hermes, and templates without tools, which
    messages_for_template teaches hermes)."""
    text = chat_template or ""
    if "<|python_tag|>" in text or "Environment: ipython" in text:
        return "llama3_json"
    return "hermes"
