"""A conversation with tool calls in it (assistant ``tool_calls``, ``tool`` results) checked and
made renderable by a chat template: through its ``tools`` variable when it has one, else taught
the hermes format in a system text (services/api/tool_parsers.py reads the answer)."""
from __future__ import annotations

import json
from typing import Any

from pdserve.engine.quoting import quoted
from pdserve.services.api.request_limits import InvalidRequest, check_count, utf8_size
from pdserve.services.api.tool_calls import MAX_TOOLS, Tool, function_of
from pdserve.services.api.tool_parsers import WHITESPACE, json_or_none

MAX_HISTORY_BYTES = 1 << 20       # every string of the messages' tool calls together
def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template reads a ``tools`` variable (found by jinja2's parser; the word itself
    when the template does not parse)."""
    if not chat_template:
        return False
    import jinja2
    import jinja2.meta
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(chat_template))
    except jinja2.TemplateError:
        return "tools" in chat_template


# ---- conversations with calls -------------------------------------------------------------------

def validate_tool_messages(messages: list, max_bytes: int = MAX_HISTORY_BYTES) -> int:
    """Check the calls in a conversation: an assistant message's ``tool_calls`` is a list of at
    most MAX_TOOLS ``{"id": str, "type": "function", "function": {"name": N, "arguments": str
    (a JSON object, or empty)}}``; a tool message has a string ``tool_call_id``. Returns the UTF-8
    bytes of those strings (at most max_bytes together) for the caller's prompt budget."""
    total = 0

    def size(text: str, where: str) -> None:
        nonlocal total
        total += utf8_size(text, where, max_bytes, "max_prompt_bytes")
        if total > max_bytes:
            raise InvalidRequest(f"messages' tool calls have more than {max_bytes} bytes (max_prompt_bytes)",
                                 "messages", "request_too_large", too_large=True)

    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        where = f"messages[{i}]"
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant":
                raise InvalidRequest(f"{where}.tool_calls is only allowed in an assistant message",
                                     f"{where}.tool_calls")
            if not isinstance(calls, list):
                raise InvalidRequest(f"{where}.tool_calls must be a list, got {quoted(calls)}", f"{where}.tool_calls")
            check_count(len(calls), f"{where}.tool_calls", MAX_TOOLS, "max_tools", "calls")
            for j, call in enumerate(calls):
                _check_call(call, f"{where}.tool_calls[{j}]", size)
        if m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}.tool_call_id must be a string, got {quoted(call_id)}",
                                     f"{where}.tool_call_id")
            size(call_id, f"{where}.tool_call_id")
    return total


def _check_call(call: Any, where: str, size) -> None:
    if not isinstance(call, dict):
        raise InvalidRequest(f"{where} must be an object, got {quoted(call)}", where)
    if not isinstance(call.get("id"), str):
        raise InvalidRequest(f"{where}.id must be a string, got {quoted(call.get('id'))}", f"{where}.id")
    size(call["id"], f"{where}.id")
    function, name = function_of(call, where)
    size(name, f"{where}.function.name")
    args = function.get("arguments")
    if not isinstance(args, str):
        raise InvalidRequest(f"{where}.function.arguments must be a string (JSON), got {quoted(args)}",
                             f"{where}.function.arguments")
    size(args, f"{where}.function.arguments")
    if args.strip(WHITESPACE) and not isinstance(json_or_none(args), dict):
        raise InvalidRequest(f"{where}.function.arguments must be a JSON object, got {quoted(args)}",
                             f"{where}.function.arguments")


def _arguments(call: dict) -> dict:
    """A checked call's arguments as a dict (an empty string: {}, as vLLM)."""
    args = call["function"].get("arguments")
    parsed = json_or_none(args) if isinstance(args, str) else args
    return parsed if isinstance(parsed, dict) else {}


HERMES_SYSTEM = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. The functions you may call "
    "are described inside <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call functions, answer with one block per call, each a JSON object with the function's name "
    "and its arguments inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>')


def hermes_call_text(name: str, arguments: dict) -> str:
    """One call as a hermes model writes it."""
    call = {"name": name, "arguments": arguments}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def messages_for_template(messages: list[dict], tools: list[Tool],
                          template_supports_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, the template's ``tools`` kwarg) for a chat template; the messages were checked
    by validate_tool_messages and are not changed (copies are returned).

    A template that reads ``tools`` (Qwen2.5/3, Llama 3.1): tools go as OpenAI tool dicts (None
    when there are none); each call's ``arguments`` becomes a dict, as HF templates expect.
    Any other (SmolLM2's ChatML): a hermes system text listing the tools (added to the first
    system message, or a new one first), calls as ``<tool_call>`` blocks in the assistant's
    content, and tool results as user messages of ``<tool_response>`` blocks (consecutive results
    in one message)."""
    if template_supports_tools:
        converted = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": _arguments(c)}}
                                   for c in m["tool_calls"]]
                if m.get("content") is None:
                    m["content"] = ""
            converted.append(m)
        return converted, [t.to_openai() for t in tools] or None
    out: list[dict] = []
    results = False               # out[-1] is a user message of tool results
    for m in messages:
        role, content = m.get("role"), _text_of(m.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        calls = [hermes_call_text(c["function"]["name"], _arguments(c)) for c in m.get("tool_calls") or ()]
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        m["content"] = "\n".join(([content] if content else []) + calls)
        out.append(m)
    if tools:
        listed = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
        text = HERMES_SYSTEM.format(tools=listed)
        if out and out[0].get("role") == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" + text) if out[0]["content"] else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
