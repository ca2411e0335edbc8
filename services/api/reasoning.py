"""Reasoning content (vLLM's ``reasoning_content``): the thinking a model writes before its
answer, split from the answer's content, whole or streamed.

Format (Qwen3, as vLLM's ``qwen3`` parser): ``<think>REASONING</think>CONTENT``. How an output
starts depends on its prompt (``start_for_prompt``):

* "thinking" (vLLM's rule, the default): everything before ``</think>`` is reasoning, whether
  or not the output opens with ``<think>`` (Qwen3-2507 Thinking and Qwen3.5 templates put
  ``<think>`` in the prompt); the first ``<think>`` before ``</think>`` is dropped. No
  ``</think>`` at all: the output was cut short while thinking, all of it is reasoning.
* "content": thinking is off (``enable_thinking=False``: the prompt ends with
  ``<think>\\n\\n</think>``): everything is content, nothing parsed (vLLM routes such output
  around its parser).
* "detect": the prompt neither opens nor closes thinking (Qwen3's original template): the output
  is "thinking" if it starts (after whitespace) with ``<think>``, else "content", so that a
  model that answers without thinking (Qwen3-2507 Instruct) keeps its content.

Empty reasoning or content is None. Streaming holds back only what may be the start of a tag,
and (in "detect") the whitespace at the start; the deltas a stream gives add up to ``extract``
of the whole text however it is split (``extract`` runs the same state machine).
"""
from __future__ import annotations

from typing import Literal

from pdserve.services.api.stream_text import partial_suffix

START, END = "<think>", "</think>"
Start = Literal["thinking", "content", "detect"]
_WS = " \t\r\n"


def reasoning_parser_for(chat_template: str | None, model_type: str | None = None) -> str | None:
    """"qwen3" when the chat template mentions ``<think>`` (Qwen3's does, and honours
    ``enable_thinking``), else None (no reasoning to split)."""
    return "qwen3" if chat_template and START in chat_template else None


def start_for_prompt(prompt: str | None, enable_thinking: bool | None = None) -> Start:
    """How the output of this rendered prompt starts (see the module's docstring): "content" when
    thinking is off (enable_thinking False, or the prompt ends with ``</think>``); "thinking" when
    the prompt ends with ``<think>`` or is not known; "detect" otherwise."""
    if enable_thinking is False:
        return "content"
    if prompt is None:
        return "thinking"
    tail = prompt.rstrip(_WS)
    if tail.endswith(END):
        return "content"
    if tail.endswith(START):
        return "thinking"
    return "detect"


class StreamingReasoningParser:
    """Splits one output into reasoning and content: ``feed`` each new piece of text, then
    ``finish``; each returns deltas in order, ``{"reasoning_content": text}`` or ``{"content":
    text}``. Or ``extract`` a whole output. One instance per output."""

    def __init__(self, start: Start = "thinking") -> None:
        self._state: str = start          # detect, thinking, content
        self._buf = ""                    # text not decided yet
        self._start_seen = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._out: list[dict] = []

    def feed(self, delta: str) -> list[dict]:
        if delta:
            self._step(delta, final=False)
        return self._take()

    def finish(self) -> list[dict]:
        self._step("", final=True)
        return self._take()

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning or None, content or None) of a whole output."""
        self.feed(text)
        self.finish()
        return "".join(self._reasoning) or None, "".join(self._content) or None

    def _step(self, delta: str, final: bool) -> None:
        if self._state == "content":
            self._emit("content", delta)
            return
        self._buf += delta
        if self._state == "detect":
            lead = self._buf.lstrip(_WS)
            if lead.startswith(START):
                self._state, self._buf = "thinking", lead
            elif START.startswith(lead) and not final:
                return        # whitespace, or what may be "<think>", so far
            else:
                self._state = "content"
                self._emit("content", self._buf)
                self._buf = ""
                return
        while True:           # thinking
            end = self._buf.find(END)
            start = -1 if self._start_seen else self._buf.find(START)
            if start >= 0 and (end < 0 or start < end):
                self._emit("reasoning_content", self._buf[:start])
                self._buf, self._start_seen = self._buf[start + len(START):], True
                continue
            if end >= 0:
                self._emit("reasoning_content", self._buf[:end])
                rest, self._buf, self._state = self._buf[end + len(END):], "", "content"
                self._emit("content", rest)
                return
            tags = (END,) if self._start_seen else (START, END)
            keep = 0 if final else partial_suffix(self._buf, tags)
            self._emit("reasoning_content", self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return

    def _emit(self, key: str, text: str) -> None:
        if not text:
            return
        (self._reasoning if key == "reasoning_content" else self._content).append(text)
        if self._out and key in self._out[-1]:
            self._out[-1] = {key: self._out[-1][key] + text}
        else:
            self._out.append({key: text})

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out


def extract_reasoning(text: str, start: Start = "thinking") -> tuple[str | None, str | None]:
    """(reasoning or None, content or None) of a whole output."""
    return StreamingReasoningParser(start).extract(text)
