"""Structured outputs, tool calls and penalties through real deployments (issue 45), with the real
`openai` client: the default model (SmolLM2-135M-Instruct) behind a router with 1 prefill + 1
decode worker (the first token sampled under the constraint on the prefill side, the rest on the
decode side, which rebuilds the grammar's state from the tokens), and the tiny model behind
colocated workers and behind a decode worker killed mid-answer (the request continues on
another with exactly the tokens of one uninterrupted run)."""
from __future__ import annotations

import asyncio
import json
import re
import signal

import grpc
import jsonschema
import openai
import pytest

from pdserve.engine import LLM, SamplingParams, StructuredOutputsParams
from pdserve.services.client import Client
from pdserve.services.deployment.launcher import free_port
from tests.conftest import random_prompts
from tests.faults.harness import FAULT_ENGINE, FaultCluster, observe, wait_for
from tests.json_schemas import schemas
from tests.serving import TEST_ENGINE_ARGS, assert_blocks_at_baseline, start_cluster

REAL_ENGINE = ["--block-size", "16", "--num-kv-blocks", "2048", "--dtype", "bfloat16"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
# one earlier turn where the assistant called the tool: how a small model learns the format
ONE_SHOT = [{"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_rome", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]}]


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def real(default_model: str):
    http_port = free_port()
    c = start_cluster(default_model, engine_args=REAL_ENGINE, router_args=["--http-port", str(http_port)])
    c.http = f"http://127.0.0.1:{http_port}"
    c.model = default_model
    try:
        yield c
    finally:
        c.stop()


async def _schema_answer(client: openai.AsyncOpenAI, model: str, i: int, schema: dict) -> list[str]:
    """The texts of one request for schema i: streamed or not, n=2 or 1, with logprobs or not."""
    messages = [{"role": "user", "content": f"Give an example JSON object for this schema: {json.dumps(schema)}"}]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": i % 3 != 0}}
    kwargs = dict(model=model, messages=messages, max_tokens=256, temperature=0.0 if i % 2 else 0.7, seed=i,
                  response_format=fmt, logprobs=i % 4 == 2, n=2 if i % 4 == 1 else 1)
    if i % 4 == 3:
        text = ""
        async for event in await client.chat.completions.create(stream=True, **kwargs):
            if event.choices:
                text += event.choices[0].delta.content or ""
        return [text]
    out = await client.chat.completions.create(**kwargs)
    if kwargs["logprobs"]:
        assert out.choices[0].logprobs.content and all(e.logprob <= 0 for e in out.choices[0].logprobs.content)
    assert len(out.choices) == kwargs["n"]
    return [c.message.content for c in out.choices]


def test_fifty_json_schemas_all_validate_streamed_and_not(real) -> None:
    cases = schemas(50)

    async def run() -> list[list[str]]:
        async with _client(real.http) as client:
            return await asyncio.gather(*(_schema_answer(client, real.model, i, s) for i, s in enumerate(cases)))

    answers = asyncio.run(run())
    checked = 0
    for schema, texts in zip(cases, answers):
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
            checked += 1
    assert checked == 50 + sum(1 for i in range(50) if i % 4 == 1)
    assert_blocks_at_baseline(real)


def test_regex_and_choice_constraints_hold_through_every_field(real) -> None:
    regex = r"[A-Z][a-z]{2,8} [0-9]{2}"
    choices = ["Paris", "London", "Berlin"]
    bodies = [{"structured_outputs": {"regex": regex}}, {"guided_regex": regex},
              {"structured_outputs": {"choice": choices}}, {"guided_choice": choices}]

    async def run():
        async with _client(real.http) as client:
            calls = [client.chat.completions.create(
                model=real.model, messages=[{"role": "user", "content": "Name a city and a number."}],
                max_tokens=24, temperature=t, seed=s, extra_body=b)
                for b in bodies for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
            calls += [client.completions.create(model=real.model, prompt="The capital of France is", max_tokens=8,
                                                temperature=0, extra_body={"guided_choice": choices})]
            return await asyncio.gather(*calls)

    outs = asyncio.run(run())
    texts = [o.choices[0].message.content for o in outs[:-1]] + [outs[-1].choices[0].text]
    for k, text in enumerate(texts):
        kind = "regex" if k < 6 else "choice"
        assert (re.fullmatch(regex, text) if kind == "regex" else text in choices), (k, text)
    assert texts[-1] == "Paris"


def test_the_grpc_door_takes_constraints_and_bad_words_and_refuses_a_bad_grammar(real) -> None:
    with Client(f"127.0.0.1:{real.spec.port}", timeout=120) as client:
        out = client.generate("The capital of France is", max_tokens=8, temperature=0,
                              structured_outputs={"choice": ["Paris", "London"]})
        assert out.text == "Paris"
        digits = client.generate("Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                 structured_outputs=StructuredOutputsParams(regex=r"( [0-9]+,){3}"))
        assert re.fullmatch(r"( [0-9]+,){3}", digits.text), digits.text
        free = client.generate("Count: 1, 2, 3,", max_tokens=6, temperature=0).text
        barred = client.generate("Count: 1, 2, 3,", max_tokens=6, temperature=0, bad_words=[free.split()[0]]).text
        assert free.split()[0] not in barred.split()[:1], (free, barred)
        with pytest.raises(grpc.RpcError) as info:
            client.generate("x", max_tokens=4, structured_outputs={"grammar": "root ::= nowhere"})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("structured_outputs.grammar does not compile")


def test_tool_call_round_trips_with_auto_required_and_named(real) -> None:
    async def run():
        async with _client(real.http) as client:
            async def ask(messages, choice, stream=False):
                kwargs = dict(model=real.model, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                              max_tokens=64, temperature=0)
                if not stream:
                    return (await client.chat.completions.create(**kwargs)).choices[0]
                calls, reason = {}, None
                async for e in await client.chat.completions.create(stream=True, **kwargs):
                    for d in (e.choices[0].delta.tool_calls or []) if e.choices else ():
                        c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                        c["id"] = d.id or c["id"]
                        c["name"] += (d.function.name or "") if d.function else ""
                        c["arguments"] += (d.function.arguments or "") if d.function else ""
                    if e.choices and e.choices[0].finish_reason:
                        reason = e.choices[0].finish_reason
                return calls, reason

            user = {"role": "user", "content": "What is the weather in Paris?"}
            auto = await ask(ONE_SHOT + [user], "auto")
            required = await ask([user], "required")
            named = await ask([user], {"type": "function", "function": {"name": "get_time"}})
            streamed = await ask([user], "required", stream=True)
            call = auto.message.tool_calls[0]
            follow = [user, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "{\"temperature\": 18, \"sky\": \"rain\"}"}]
            final = await ask(follow, "none")
            return auto, required, named, streamed, final

    auto, required, named, (streamed, reason), final = asyncio.run(run())
    for choice in (auto, required, named):
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert auto.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(auto.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert [c.function.name for c in named.message.tool_calls] == ["get_time"]
    assert reason == "tool_calls" and streamed and all(json.loads(c["arguments"]) for c in streamed.values())
    assert final.finish_reason in ("stop", "length") and final.message.content and not final.message.tool_calls


def test_penalties_bias_and_bad_words_reach_the_sampler(real) -> None:
    """Against the offline engine on the same model: the same tokens with each option, and each
    option changes the output (so none is silently dropped on the way)."""
    prompt = "List the days of the week: Monday, Tuesday,"
    options = [{"presence_penalty": 1.5}, {"frequency_penalty": 1.5}, {"repetition_penalty": 1.8},
               {"min_p": 0.3, "temperature": 1.0, "seed": 3}, {"bad_words": [" Wednesday"]}]

    async def run():
        async with _client(real.http) as client:
            def call(o: dict):
                openai_fields = {k: v for k, v in o.items() if k in ("presence_penalty", "frequency_penalty",
                                                                      "temperature", "seed")}
                extra = {k: v for k, v in o.items() if k not in openai_fields}
                return client.completions.create(model=real.model, prompt=prompt, max_tokens=24,
                                                 **{"temperature": 0, **openai_fields}, extra_body=extra)
            return await asyncio.gather(*(call(o) for o in options))

    outs = asyncio.run(run())
    plain = LLM(real.model, dtype="bfloat16", block_size=16, num_kv_blocks=256)
    base = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].text
    assert "Wednesday" in base
    for o, out in zip(options, outs):
        text = out.choices[0].text
        if "bad_words" in o:
            assert "Wednesday" not in text
        else:
            ref = plain.generate([prompt], SamplingParams(max_tokens=24, **{"temperature": 0, **o}))[0].text
            assert text == ref, o
        assert text != base, o


def test_bad_constraints_and_tools_are_refused_naming_the_field_and_the_server_stays_up(real) -> None:
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objx"}}}},
              "response_format"),
             ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
             ({"guided_grammar": "root ::= undefined"}, "guided_grammar"),
             ({"structured_outputs": {"grammar": "x" * (70 << 10)}}, "structured_outputs"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools[0]"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"logit_bias": {"99999999": 5}}, "logit_bias"), ({"presence_penalty": 3}, "presence_penalty")]

    async def run():
        async with _client(real.http) as client:
            errors = []
            for extra, _ in cases:
                try:
                    await client.chat.completions.create(model=real.model, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=4, extra_body=extra)
                    errors.append(None)
                except openai.BadRequestError as exc:
                    errors.append(exc.body)
            ok = await client.chat.completions.create(model=real.model, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4)
            return errors, ok

    errors, ok = asyncio.run(run())
    for (extra, field), body in zip(cases, errors):
        assert body is not None, extra
        assert body["param"].startswith(field.split("[")[0]) and field.split("[")[0] in body["message"] or \
            body["param"] == field, (field, body)
        assert len(body["message"]) < 400 and "x" * 60 not in body["message"]
    assert ok.choices[0].message.content is not None


# ---- the tiny model: colocated, and a decode worker killed mid-answer ------------------------------

MISSED_WINDOWS = 3


def _numbers_spec(min_items: int, max_items: int) -> StructuredOutputsParams:
    """An object of an array of min_items to max_items numbers and a short string."""
    return StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": min_items,
              "maxItems": max_items},
        "b": {"type": "string", "maxLength": 30}}, "required": ["a", "b"]})


SPEC = _numbers_spec(25, 40)
LONG_SPEC = _numbers_spec(100, 130)   # long enough (565 tokens from the tiny model) for a wide window before a kill
LONG_MAX_TOKENS = 1000


def test_constrained_output_through_colocated_workers_is_the_offline_output(tiny_qwen3: str, served_reference) -> None:
    prompts = random_prompts(3, 5, 20, seed=45)
    want = [o.token_ids for o in served_reference.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=SPEC))]
    http_port = free_port()
    cluster = start_cluster(tiny_qwen3, engine_args=TEST_ENGINE_ARGS, colocated_workers=1,
                            router_args=["--http-port", str(http_port)])
    try:
        async def run():
            async with _client(f"http://127.0.0.1:{http_port}") as client:
                return await asyncio.gather(*(client.completions.create(
                    model=tiny_qwen3, prompt=p, max_tokens=300, temperature=0, logprobs=0,
                    extra_body={"structured_outputs": {"json": json.loads(SPEC.json)}}) for p in prompts))
        outs = asyncio.run(run())
        assert [len(o.choices[0].logprobs.tokens) for o in outs] == [len(w) for w in want]
        for o, w in zip(outs, want):
            jsonschema.validate(json.loads(o.choices[0].text), json.loads(SPEC.json))
        assert_blocks_at_baseline(cluster)
    finally:
        cluster.stop()


@pytest.mark.faults
def test_a_constrained_request_whose_decode_worker_dies_continues_exactly(tiny_qwen3: str, served_reference) -> None:
    """1 prefill + 2 decode workers: once the decode worker holding the request has made 20 tokens
    (and has 400 more to make) it is caught frozen and killed; the router re-prefills prompt +
    tokens on the other, whose grammar state is rebuilt from them: the output is the uninterrupted
    one, and it follows the schema. The margin is wide because the worker runs between answering
    the catch and being frozen: with 20 tokens left (of 212) a loaded CI machine once let the
    request finish there, and its kill found nothing to move. A request that a loaded machine let
    pass the window (its tokens checked too) is sent again, up to MISSED_WINDOWS times."""
    prompt = random_prompts(1, 12, 12, seed=46)[0]
    params = SamplingParams(temperature=0.0, max_tokens=LONG_MAX_TOKENS, structured_outputs=LONG_SPEC)
    want = served_reference.generate([prompt], params)[0].token_ids
    assert len(want) > 500
    fc = FaultCluster(tiny_qwen3, prefill=1, decode=2, engine_args=FAULT_ENGINE)
    try:
        for _ in range(MISSED_WINDOWS + 1):
            obs = observe(fc.router, prompt, LONG_MAX_TOKENS, structured_outputs=LONG_SPEC)
            victim = fc.catch_decoding(obs, len(prompt), len(want), done_tokens=20, left_tokens=400)
            if victim is not None:
                break
            assert obs.done.wait(60) and obs.code is None and obs.tokens == want, obs
            wait_for(fc.at_baseline, 30, "free blocks at baseline")
        assert victim is not None, f"every request ended before its kill: {obs}"
        fc.signal(victim, signal.SIGKILL)
        assert obs.done.wait(120), fc.logs()
        assert obs.code is None, (obs.code, obs.details, fc.logs())
        assert obs.migrations >= 1 and obs.tokens == want
        jsonschema.validate(json.loads(served_reference.tokenizer.decode(obs.tokens, skip_special_tokens=True)), json.loads(LONG_SPEC.json))
        wait_for(fc.all_healthy, 60, "the killed worker restarted")
        wait_for(fc.at_baseline, 30, "free blocks at baseline")
    finally:
        fc.close()
