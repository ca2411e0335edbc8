"""OpenAI tool calling for the chat API, the request's side: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked, and the JSON schema that forces a call (tool_choice "required"
or a named function). The model's output is parsed by services/api/tool_parsers.py; a
conversation with calls in it is made renderable by services/api/tool_messages.py.

* ``tools``: ``[{"type": "function", "function": {"name": N, "description": D?, "parameters":
  JSON-schema object?, "strict": bool?}}]``, N matching ``[a-zA-Z0-9_-]{1,64}``.
* ``tool_choice``: ``"none" | "auto" | "required" | {"type": "function", "function": {"name": N}}``.
* guided output: "required": ``[{"name": N, "parameters": {...}}, ...]``; named: the arguments
  object itself.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve.engine.quoting import quoted
from pdserve.engine.sampling_params import MAX_STRUCTURED_BYTES
from pdserve.services.api.request_limits import InvalidRequest, check_count, utf8_size

MAX_TOOLS = 64                    # tools in one request (and tool calls in one assistant message)
MAX_TOOLS_BYTES = 64 << 10        # all tools together, serialized as compact JSON (UTF-8)
MAX_SCHEMA_DEPTH = 64             # nesting of a parameters schema (objects and arrays)
DEFAULT_PARAMETERS: dict = {"type": "object", "properties": {}}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


# ---- the request's fields -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str | None = None
    parameters: dict = field(default_factory=lambda: copy.deepcopy(DEFAULT_PARAMETERS))
    strict: bool | None = None

    def to_openai(self) -> dict:
        """OpenAI's tool dict (what a chat template's ``tools`` holds)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """mode "function": the model must call ``name``."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None


def _depth(value: Any) -> int:
    """Nesting of lists and dicts in value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_SCHEMA_DEPTH:
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be a JSON schema object, got {quoted(schema)}", where)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(f"{where} is nested more than {MAX_SCHEMA_DEPTH} levels deep", where)
    import jsonschema   # only a request with tools pays for the import
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "/".join(str(p) for p in exc.absolute_path) or "its root"
        raise InvalidRequest(f"{where} is not a valid JSON schema, at {at}: {quoted(exc.message, 120)}",
                             where) from None
    except RecursionError:
        raise InvalidRequest(f"{where} is nested too deeply", where) from None


def parse_tools(value: Any, max_tools: int = MAX_TOOLS, max_bytes: int = MAX_TOOLS_BYTES) -> list[Tool]:
    """The request's ``tools`` ([] when absent), each checked; InvalidRequest names the exact path
    (``tools[3].function.parameters``). Order: the count, then each tool's size (all together at
    most max_bytes, compact JSON), then its shape and its parameters' schema."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"tools must be a list of tools, got {quoted(value)}", "tools")
    check_count(len(value), "tools", max_tools, "max_tools", "tools")
    total, tools, seen = 0, [], {}
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        try:
            text = json.dumps(item, ensure_ascii=False, separators=(",", ":"))
        except RecursionError:
            raise InvalidRequest(f"{where} is nested too deeply", where) from None
        total += utf8_size(text, where, max_bytes, "max_tools_bytes")
        if total > max_bytes:
            raise InvalidRequest(f"tools have more than {max_bytes} bytes (max_tools_bytes)", "tools",
                                 "request_too_large", too_large=True)
        tool = _parse_tool(item, where)
        if tool.name in seen:
            raise InvalidRequest(f"{where}.function.name {quoted(tool.name)} is already the name of "
                                 f"tools[{seen[tool.name]}]", f"{where}.function.name")
        seen[tool.name] = i
        tools.append(tool)
    return tools


def function_of(item: Any, where: str) -> tuple[dict, str]:
    """(its "function" object, the function's name) of a tool or a tool call: ``{"type":
    "function" (the default), "function": {"name": N, ...}}``; InvalidRequest naming the path."""
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where} must be an object, got {quoted(item)}", where)
    if item.get("type", "function") != "function":
        raise InvalidRequest(f"{where}.type must be 'function', got {quoted(item.get('type'))}", f"{where}.type")
    function = item.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest(f"{where}.function must be an object, got {quoted(function)}", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidRequest(f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {quoted(name)}",
                             f"{where}.function.name")
    return function, name


def _parse_tool(item: Any, where: str) -> Tool:
    function, name = function_of(item, where)
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.function.description must be a string, got {quoted(description)}",
                             f"{where}.function.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{where}.function.strict must be a boolean, got {quoted(strict)}",
                             f"{where}.function.strict")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = copy.deepcopy(DEFAULT_PARAMETERS)
    else:
        _check_schema(parameters, f"{where}.function.parameters")
    return Tool(name, description, parameters, strict)


def parse_tool_choice(value: Any, tools: list[Tool]) -> ToolChoice:
    """The request's ``tool_choice``: default "auto" with tools, "none" without; "required" or a
    named function need tools (the name one of them); "auto" without tools is "none"."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(value if tools else "none")
    if not isinstance(value, dict):
        raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {quoted(value)}", "tool_choice")
    if value.get("type") != "function":
        raise InvalidRequest(f"tool_choice.type must be 'function', got {quoted(value.get('type'))}",
                             "tool_choice.type")
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest(f"tool_choice.function.name must be a string, got {quoted(name)}",
                             "tool_choice.function.name")
    if all(t.name != name for t in tools):
        raise InvalidRequest(f"tool_choice.function.name {quoted(name)} is not the name of one of the tools",
                             "tool_choice.function.name")
    return ToolChoice("function", name)


def parse_parallel_tool_calls(value: Any) -> bool:
    """The request's ``parallel_tool_calls``: a boolean, default True."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise InvalidRequest(f"parallel_tool_calls must be a boolean, got {quoted(value)}", "parallel_tool_calls")
    return value


# ---- forcing a call: guided decoding ------------------------------------------------------------

_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})   # values, not schemas


def _rebased(schema: Any, base: str) -> Any:
    """schema with each local ``$ref`` ("#", "#/...") pointing under base (the JSON pointer where
    the schema now sits in a larger document); a schema with its own ``$id`` is left alone."""
    if isinstance(schema, dict) and "$id" in schema:
        return copy.deepcopy(schema)

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, child in node.items():
            if key == "$ref" and isinstance(child, str) and (child == "#" or child.startswith("#/")):
                out[key] = "#" + base + child[1:]
            elif key in _DATA_KEYWORDS:
                out[key] = copy.deepcopy(child)
            else:
                out[key] = walk(child)
        return out
    return walk(schema)


def guided_schema(tools: list[Tool], choice: ToolChoice, parallel: bool = True) -> dict | None:
    """The JSON schema the output must follow, or None ("auto", "none": free output).
    "required": an array (minItems 1; maxItems 1 unless parallel) of ``{"name": N, "parameters":
    ARGS}``, anyOf over the tools (N const, both required, nothing else); local ``$ref``s of each
    tool's schema are rebased to where it now sits. A named function: its parameters schema (the
    output is the arguments), as vLLM."""
    if choice.mode == "function":
        tool = next(t for t in tools if t.name == choice.name)
        return _bounded(copy.deepcopy(tool.parameters))
    if choice.mode != "required":
        return None
    branches = []
    for k, tool in enumerate(tools):
        base = f"/items/anyOf/{k}/properties/parameters"
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "const": tool.name},
                                        "parameters": _rebased(tool.parameters, base)},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return _bounded(schema)


def _bounded(schema: dict) -> dict:
    """schema, refused when larger than the engine takes (MAX_STRUCTURED_BYTES: the wrapping and
    the rebased $refs make it larger than the tools)."""
    size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode())
    if size > MAX_STRUCTURED_BYTES:
        raise InvalidRequest(f"tools make a {size}-byte schema to force tool_choice; the limit is "
                             f"{MAX_STRUCTURED_BYTES} (MAX_STRUCTURED_BYTES)", "tools", "request_too_large",
                             too_large=True)
    return schema
