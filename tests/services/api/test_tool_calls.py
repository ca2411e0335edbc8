"""OpenAI tools (services/api/tool_calls.py): the request's fields checked naming the exact path,
the schemas that force a call validating real outputs, the hermes and llama3_json parsers on
realistic outputs, streaming adding up to the whole-output result on every split, and
conversations with calls rendered by templates with and without tool support."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pdserve.services.api.request_limits import InvalidRequest
from pdserve.services.api.tool_calls import (MAX_TOOLS_BYTES, Tool, ToolChoice, guided_schema,
    parse_parallel_tool_calls, parse_tool_choice, parse_tools)
from pdserve.services.api.tool_messages import messages_for_template, template_supports_tools, validate_tool_messages
from pdserve.services.api.tool_parsers import (HermesToolParser, Llama3JsonToolParser, ToolCall,
    calls_from_guided_output, extract_tool_calls, guided_parser, parser_for_template, to_openai, tool_parser)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
    "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "add-note", "parameters": {
    "type": "object", "$defs": {"tag": {"type": "string", "maxLength": 8}},
    "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}}}, "required": ["tags"]}}}


def _tools(*items: dict) -> list[Tool]:
    return parse_tools(list(items))


# ---- validation ---------------------------------------------------------------------------------

def test_tools_parse_with_their_defaults() -> None:
    tools = parse_tools([WEATHER, {"type": "function", "function": {"name": "ping", "strict": True}}])
    assert [t.name for t in tools] == ["get_weather", "ping"]
    assert tools[0].description == "The weather in a city"
    assert tools[1].parameters == {"type": "object", "properties": {}} and tools[1].strict is True
    assert tools[0].to_openai() == WEATHER
    assert parse_tools(None) == [] and parse_tools([]) == []


def _refused(value, field: str, *words: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_tools(value)
    assert info.value.field == field, info.value.message
    assert field in info.value.message
    for word in words:
        assert word in info.value.message
    assert len(info.value.message) < 300
    return info.value


def _with(function: dict, i: int = 2) -> list:
    return [WEATHER, TIME, {"type": "function", "function": function}][:i] + [{"type": "function",
                                                                             "function": function}]


@pytest.mark.parametrize("value, field, words", [
    ("get_weather", "tools", ["a list"]),
    ([WEATHER] * 65, "tools", ["65", "64"]),
    ([WEATHER, "x"], "tools[1]", ["an object"]),
    ([WEATHER, {"type": "code_interpreter"}], "tools[1].type", ["'function'", "code_interpreter"]),
    ([{"type": "function"}], "tools[0].function", ["an object"]),
    (_with({"name": "get weather"}), "tools[2].function.name", ["64", "'get weather'"]),
    (_with({"name": "x" * 65}), "tools[2].function.name", ["64"]),
    (_with({"name": "ok\n"}), "tools[2].function.name", []),
    (_with({"name": 7}), "tools[2].function.name", []),
    (_with({"name": "f", "description": 3}), "tools[2].function.description", ["a string"]),
    (_with({"name": "f", "strict": "yes"}), "tools[2].function.strict", ["a boolean"]),
    (_with({"name": "f", "parameters": []}), "tools[2].function.parameters", ["JSON schema object"]),
    (_with({"name": "f", "parameters": {"type": "strin"}}), "tools[2].function.parameters",
     ["not a valid JSON schema", "type"]),
    (_with({"name": "f", "parameters": {"properties": {"a": {"minLength": -1}}}}), "tools[2].function.parameters",
     ["properties/a/minLength"]),
    (_with({"name": "f", "parameters": {"type": "string", "pattern": "(unclosed"}}), "tools[2].function.parameters",
     ["pattern"]),
    ([WEATHER, TIME, WEATHER], "tools[2].function.name", ["'get_weather'", "tools[0]"]),
])
def test_a_wrong_tool_is_refused_naming_its_path(value, field: str, words: list[str]) -> None:
    _refused(value, field, *words)


def test_a_huge_or_deep_tool_is_refused_without_being_quoted() -> None:
    big = {"type": "function", "function": {"name": "f", "description": "x" * (1 << 20)}}
    exc = _refused([WEATHER, big], "tools[1]", str(MAX_TOOLS_BYTES))
    assert exc.too_large and "xxxx" not in exc.message
    many = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 2000}} for i in range(40)]
    exc = _refused(many, "tools", str(MAX_TOOLS_BYTES))
    assert exc.too_large and "dddd" not in exc.message
    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    _refused(_with({"name": "f", "parameters": deep}), "tools[2].function.parameters", "nested")
    _refused([{"type": "function", "function": {"name": "f", "description": "\ud800"}}], "tools[0]", "Unicode")
    long_text = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin" + "g" * 5000}}}
    exc = _refused([long_text], "tools[0].function.parameters")
    assert "g" * 200 not in exc.message


def test_tool_choice_and_parallel_calls() -> None:
    tools = _tools(WEATHER, TIME)
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("auto", []) == ToolChoice("none")
    assert parse_tool_choice("none", tools) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tool_choice(named, tools) == ToolChoice("function", "get_time")
    for value, field in [("required", "tool_choice"), ("always", "tool_choice"), (3, "tool_choice"),
                         ({"type": "tool", "function": {"name": "get_time"}}, "tool_choice.type"),
                         ({"type": "function"}, "tool_choice.function.name"),
                         ({"type": "function", "function": {"name": "nope" * 100}}, "tool_choice.function.name")]:
        with pytest.raises(InvalidRequest) as info:
            parse_tool_choice(value, tools if value != "required" else [])
        assert info.value.field == field and field in info.value.message and len(info.value.message) < 200
    assert parse_parallel_tool_calls(None) is True and parse_parallel_tool_calls(False) is False
    with pytest.raises(InvalidRequest, match="parallel_tool_calls must be a boolean"):
        parse_parallel_tool_calls("no")


# ---- guided decoding ----------------------------------------------------------------------------

def _valid(schema: dict, text: str) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


def test_the_required_schema_admits_calls_and_only_calls() -> None:
    tools = _tools(WEATHER, TIME, NOTE)
    schema = guided_schema(tools, ToolChoice("required"), parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = ['[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
            '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": '
            '{"city": "Oslo", "unit": "celsius"}}]',
            '[{"name": "add-note", "parameters": {"tags": ["a", "b"]}}]']
    bad = ['[]', '{"name": "get_time", "parameters": {"zone": "UTC"}}',
           '[{"name": "get_clock", "parameters": {"zone": "UTC"}}]',
           '[{"name": "get_time"}]', '[{"parameters": {"zone": "UTC"}}]',
           '[{"name": "get_time", "parameters": {"zone": "UTC"}, "why": "x"}]',
           '[{"name": "get_time", "parameters": {"zone": 3}}]',
           '[{"name": "get_time", "parameters": {"city": "Paris"}}]',
           '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}]',
           '[{"name": "add-note", "parameters": {"tags": ["far too long"]}}]']   # through the rebased $ref
    assert all(_valid(schema, t) for t in good)
    assert not any(_valid(schema, t) for t in bad)
    single = guided_schema(tools, ToolChoice("required"), parallel=False)
    assert _valid(single, good[0]) and not _valid(single, good[1])
    calls = calls_from_guided_output(good[1], tools, ToolChoice("required"))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert tools[2].parameters["properties"]["tags"]["items"] == {"$ref": "#/$defs/tag"}   # not changed


def test_the_named_schema_is_the_arguments() -> None:
    tools = _tools(WEATHER, TIME, NOTE)
    choice = parse_tool_choice({"type": "function", "function": {"name": "add-note"}}, tools)
    schema = guided_schema(tools, choice)
    assert schema == NOTE["function"]["parameters"] and schema is not tools[2].parameters
    assert _valid(schema, '{"tags": ["x"]}') and not _valid(schema, '{"tags": ["far too long"]}')
    (call,) = calls_from_guided_output(' {"tags": ["x"]}\n', tools, choice)
    assert (call.name, call.arguments) == ("add-note", '{"tags": ["x"]}')
    assert guided_schema(tools, ToolChoice("auto")) is None and guided_schema(tools, ToolChoice("none")) is None


def test_a_forcing_schema_larger_than_the_engine_takes_is_refused() -> None:
    params = {"type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/t"} for i in range(300)},
              "$defs": {"t": {"type": "string"}}}
    tools = parse_tools([{"type": "function", "function": {"name": f"f{k}", "parameters": params}} for k in range(6)])
    guided_schema(tools, ToolChoice("function", "f0"))
    with pytest.raises(InvalidRequest) as info:
        guided_schema(tools, ToolChoice("required"))
    assert info.value.too_large and info.value.field == "tools" and "tool_choice" in info.value.message


def test_guided_schemas_compile_for_the_engine() -> None:
    pytest.importorskip("xgrammar")
    from pdserve.engine.sampling_params import StructuredOutputsParams
    from pdserve.engine.structured import check_structured
    tools = _tools(WEATHER, TIME, NOTE)
    for choice in (ToolChoice("required"), ToolChoice("function", "add-note")):
        check_structured(StructuredOutputsParams(json=guided_schema(tools, choice, parallel=False)))


def test_guided_output_streams_as_whole() -> None:
    tools = _tools(WEATHER, TIME)
    texts = ['[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": '
             '{"city": "a}\\"]"}}]', '[{"name": "get_time", "parameters": {"zone": "U',
             'not json', '[{"name": "get_time", "parameters": {}}, {"oops": 1}]']
    for text in texts:
        _check_splits(lambda: guided_parser(tools, ToolChoice("required")), text)
        _check_splits(lambda: guided_parser(tools, ToolChoice("function", "get_time")), text)
    content, calls = guided_parser(tools, ToolChoice("required")).extract(texts[1])
    assert calls == [] and content == texts[1]     # cut short: no call, the text stays
    content, calls = guided_parser(tools, ToolChoice("required")).extract(texts[3])
    assert [c.name for c in calls] == ["get_time"] and content == ', {"oops": 1}]'


# ---- parsing the model's output -----------------------------------------------------------------

def _stream(factory, pieces: list[str]) -> list[dict]:
    parser = factory()
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    return deltas + parser.finish()


def _assemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = "", []
    for d in deltas:
        if "content" in d:
            assert set(d) == {"content"} and d["content"]
            content += d["content"]
            continue
        assert set(d) == {"tool_calls"} and len(d["tool_calls"]) == 1
        tc = d["tool_calls"][0]
        if "id" in tc:
            assert tc["index"] == len(calls) and tc["type"] == "function" and tc["id"].startswith("call_")
            assert tc["function"]["arguments"] == ""
            calls.append([tc["function"]["name"], ""])
        else:
            assert tc["index"] == len(calls) - 1 and set(tc) == {"index", "function"}
            calls[-1][1] += tc["function"]["arguments"]
    return content or None, [tuple(c) for c in calls]


def _whole(factory, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = factory().extract(text)
    return content, [(c.name, c.arguments) for c in calls]


def _check_splits(factory, text: str, random_splits: int = 40) -> None:
    expected = _whole(factory, text)
    assert _assemble(_stream(factory, [text])) == expected
    assert _assemble(_stream(factory, list(text))) == expected, "one character at a time"
    for i in range(len(text) + 1):
        assert _assemble(_stream(factory, [text[:i], text[i:]])) == expected, f"split at {i}: {text[:i]!r}"
    rng = random.Random(len(text))
    for _ in range(random_splits):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _assemble(_stream(factory, pieces)) == expected, pieces


HERMES_TEXTS = {
    "one call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "content first": 'Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n'
                     '</tool_call>\n',
    "tricky strings": '<tool_call>\n{"name": "write", "arguments": {"text": "a } b </tool_call> <tool_call> \\" {"'
                      ', "n": {"deep": [1, {"x": "<"}]}}}\n</tool_call>',
    "malformed": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    "no call": 'The weather in Paris is <b>sunny</b> < 30 degrees; use <tool_call tags> when needed.',
    "unclosed call": 'Calling.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n',
    "unclosed garbage": 'Calling.\n<tool_call>\n{"name": "get_time", "argu',
    "text after": '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\nDone, see above. ',
    "not a call": '<tool_call>\n["get_time"]\n</tool_call>\n  <tool_call>{"arguments": {}}</tool_call>',
    "unicode": 'Météo ☀ <tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich ☃"}}\n</tool_call>',
    "spaces only": '\n\n  ',
}


def test_hermes_whole_outputs() -> None:
    h = lambda key: extract_tool_calls(HERMES_TEXTS[key], "hermes")   # noqa: E731
    content, calls = h("one call")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    content, calls = h("content first")
    assert content == "Let me check both.\n\n" and [c.name for c in calls] == ["get_weather", "get_time"]
    content, calls = h("tricky strings")
    assert content is None and json.loads(calls[0].arguments) == {
        "text": 'a } b </tool_call> <tool_call> " {', "n": {"deep": [1, {"x": "<"}]}}
    content, calls = h("malformed")   # the malformed block stays, the good one is a call
    assert content == ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>\n')
    assert [c.name for c in calls] == ["get_time"]
    assert h("no call") == (HERMES_TEXTS["no call"], [])
    content, calls = h("unclosed call")
    assert content == "Calling.\n" and [c.name for c in calls] == ["get_time"]
    assert h("unclosed garbage") == (HERMES_TEXTS["unclosed garbage"], [])
    content, calls = h("text after")
    assert content == "\n\nDone, see above. " and calls[0].arguments == "{}"
    content, calls = h("not a call")
    assert content == HERMES_TEXTS["not a call"] and calls == []
    content, calls = h("unicode")
    assert content == "Météo ☀ " and calls[0].arguments == '{"city": "Zürich ☃"}'
    assert h("spaces only") == ("\n\n  ", [])
    assert extract_tool_calls("", "hermes") == (None, [])


@pytest.mark.parametrize("key", sorted(HERMES_TEXTS))
def test_hermes_streaming_adds_up_to_the_whole_output(key: str) -> None:
    _check_splits(HermesToolParser, HERMES_TEXTS[key])


def test_hermes_streams_content_at_once_and_holds_only_a_possible_tag() -> None:
    parser = HermesToolParser()
    assert parser.feed("Hello <b>") == [{"content": "Hello <b>"}]
    assert parser.feed(" x <tool_") == [{"content": " x "}]
    assert parser.feed("call>\n{\"name\": \"f\", ") == []
    deltas = parser.feed('"arguments": {"a": 1}}\n</tool_call>')
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}
    assert parser.feed("\n") == [] and parser.finish() == []   # whitespace after a call: dropped


LLAMA_TEXTS = {
    "one call": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "python tag": '<|python_tag|>{"name": "get_time", "arguments": {"zone": "UTC"}}',
    "several": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b}"}}; '
               '{"name": "get_time", "parameters": {"zone": "UTC"}};',
    "plain text": "It is sunny in Paris {probably}.",
    "json answer": '{"answer": 42, "why": "{}"}',
    "malformed": '{"name": "get_time", "parameters": {"zone": "UTC"}',
    "calls then text": '{"name": "get_time", "parameters": {}}\nThat is all; thanks.',
    "second bad": '{"name": "get_time", "parameters": {}}; {"name": 3}',
    "leading space": '  \n{"name": "get_time", "parameters": {"zone": "<\\"}"}}\n',
    "tag then code": '<|python_tag|>brave_search.call(query="x")',
}


def test_llama3_json_whole_outputs() -> None:
    ll = lambda key: _whole(Llama3JsonToolParser, LLAMA_TEXTS[key])   # noqa: E731
    assert ll("one call") == (None, [("get_weather", '{"city": "Paris"}')])
    assert ll("python tag") == (None, [("get_time", '{"zone": "UTC"}')])
    assert ll("several") == (None, [("get_weather", '{"city": "a;b}"}'), ("get_time", '{"zone": "UTC"}')])
    for key in ("plain text", "json answer", "malformed", "tag then code"):
        assert ll(key) == (LLAMA_TEXTS[key], []), key
    assert ll("calls then text") == ("\nThat is all; thanks.", [("get_time", "{}")])
    assert ll("second bad") == ('; {"name": 3}', [("get_time", "{}")])
    assert ll("leading space") == (None, [("get_time", '{"zone": "<\\"}"}')])


@pytest.mark.parametrize("key", sorted(LLAMA_TEXTS))
def test_llama3_json_streaming_adds_up_to_the_whole_output(key: str) -> None:
    _check_splits(Llama3JsonToolParser, LLAMA_TEXTS[key])


def test_parsers_are_chosen_by_template() -> None:
    assert parser_for_template("{{ '<|python_tag|>' }}Environment: ipython", "llama") == "llama3_json"
    assert parser_for_template("<|im_start|>{% if tools %}<tool_call>{% endif %}", "qwen2") == "hermes"
    assert parser_for_template(None, None) == "hermes"
    assert isinstance(tool_parser("llama3_json"), Llama3JsonToolParser)
    assert template_supports_tools(QWEN_LIKE) and not template_supports_tools(SMOLLM2)
    assert not template_supports_tools(None)


def test_to_openai_shapes() -> None:
    call = ToolCall("f", '{"a": 1}', "call_x")
    assert to_openai(call) == {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert to_openai(call, 2)["index"] == 2


# ---- conversations with calls -------------------------------------------------------------------

# SmolLM2-135M-Instruct's chat template (ChatML, no tools)
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# the shape of Qwen2.5's tool section
QWEN_LIKE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are Qwen.{% endif %}

# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATION = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def _render(template: str, messages: list[dict], tools: list[dict] | None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                        add_generation_prompt=True)
    return rendered[0]


def test_a_template_without_tools_gets_them_in_hermes_form() -> None:
    tools = _tools(WEATHER, TIME)
    snapshot = json.dumps(CONVERSATION)
    messages, kwarg = messages_for_template(CONVERSATION, tools, template_supports_tools(SMOLLM2))
    assert kwarg is None and json.dumps(CONVERSATION) == snapshot   # the caller's messages are not changed
    text = _render(SMOLLM2, messages, kwarg)
    assert text.startswith("<|im_start|>system\n# Tools") and "You are a helpful AI assistant" not in text
    assert json.dumps(tools[0].to_openai()) in text and "<tools>" in text and "</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>') in text
    assert ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n12:00\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in text
    # an existing system message gets the tools after its own text
    messages, _ = messages_for_template([{"role": "system", "content": "Be brief."}] + CONVERSATION, tools, False)
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and messages[1]["role"] == "user"
    # no tools: the conversation alone
    messages, _ = messages_for_template(CONVERSATION[:1], [], False)
    assert messages == CONVERSATION[:1]


def test_a_template_with_tools_gets_them_as_its_kwarg() -> None:
    tools = _tools(WEATHER, TIME)
    messages, kwarg = messages_for_template(CONVERSATION, tools, template_supports_tools(QWEN_LIKE))
    assert kwarg == [WEATHER, TIME]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    text = _render(QWEN_LIKE, messages, kwarg)
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text   # a dict, not a quoted string
    assert '{"name": "get_time", "arguments": {}}' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text
    assert messages_for_template(CONVERSATION[:1], [], True) == (CONVERSATION[:1], None)


def test_tool_messages_are_checked_naming_their_path() -> None:
    strings = ["call_1", "get_weather", '{"city": "Paris"}', "call_2", "get_time", "", "call_1", "call_2"]
    assert validate_tool_messages(CONVERSATION) == sum(map(len, strings))
    cases = [
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[1].tool_calls", "assistant"),
        ({"role": "assistant", "tool_calls": {"id": "x"}}, "messages[1].tool_calls", "a list"),
        ({"role": "assistant", "tool_calls": [{}] * 65}, "messages[1].tool_calls", "64"),
        ({"role": "assistant", "tool_calls": ["x"]}, "messages[1].tool_calls[0]", "an object"),
        ({"role": "assistant", "tool_calls": [{"id": 1}]}, "messages[1].tool_calls[0].id", "a string"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "a b", "arguments": "{}"}}]},
         "messages[1].tool_calls[0].function.name", "'a b'"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]},
         "messages[1].tool_calls[0].function.arguments", "a string"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{" * 5000}}]},
         "messages[1].tool_calls[0].function.arguments", "a JSON object"),
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id", "a string"),
    ]
    for message, field, word in cases:
        with pytest.raises(InvalidRequest) as info:
            validate_tool_messages([{"role": "user", "content": "hi"}, message])
        assert info.value.field == field and field in info.value.message and word in info.value.message
        assert len(info.value.message) < 300
    with pytest.raises(InvalidRequest) as info:
        validate_tool_messages(CONVERSATION, max_bytes=20)
    assert info.value.too_large
