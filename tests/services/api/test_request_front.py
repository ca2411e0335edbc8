"""The request front (services/api/request_front.py) without servers: limits named in its errors,
token-id and text prompts, chat rendering, sampling validation, tokenizing off the event loop,
and the gRPC and HTTP mappings of one request giving the same validated request."""
from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.v1 import common_pb2, router_pb2
from pdserve.services.common.proto_convert import params_from_proto, params_to_proto
from pdserve.services.api.openai_protocol import HTTPError, front_requests, parse_body
from pdserve.services.api.request_limits import InvalidRequest, RequestLimits
from pdserve.services.api.request_front import FrontRequest, Prompt, RequestFront, ValidatedRequest
from pdserve.services.api.grpc_router import front_request

MAX_LEN = 128
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: str):
    return load_tokenizer(tiny_qwen3)


@pytest.fixture
def front(tokenizer) -> RequestFront:
    return RequestFront(tokenizer, tokenizer.vocab_size, RequestLimits(max_prompt_bytes=1000), lambda: MAX_LEN, "m")


def _prepare(front: RequestFront, request: FrontRequest) -> ValidatedRequest:
    return asyncio.run(front.prepare(request))


def _refusal(front: RequestFront, request: FrontRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        _prepare(front, request)
    return info.value


def test_text_and_token_id_prompts(front: RequestFront, tokenizer) -> None:
    text = _prepare(front, FrontRequest("r", SamplingParams(), Prompt(text="hello world")))
    assert text.prompt == tokenizer.encode("hello world") and text.request_id == "r"
    assert text.params == SamplingParams() and text.params.max_tokens == 16   # SamplingParams' default
    ids = _prepare(front, FrontRequest("r", SamplingParams(), Prompt(token_ids=(5, 6, 7))))
    assert ids.prompt == [5, 6, 7] and isinstance(ids.prompt, list)


def test_a_token_id_prompt_is_measured_before_it_is_copied(front: RequestFront) -> None:
    class Huge:   # a length, and no elements: copying it would fail the test
        def __len__(self) -> int:
            return 10**9

        def __iter__(self):
            raise AssertionError("copied before its length was checked")

    err = _refusal(front, FrontRequest("r", SamplingParams(), Prompt(token_ids=Huge())))
    assert (err.field, err.message) == ("prompt", f"prompt has {10**9} tokens; max_model_len is {MAX_LEN}")


def test_limits_are_named(front: RequestFront) -> None:
    err = _refusal(front, FrontRequest("r", SamplingParams(), Prompt(text="x" * 1001)))
    assert (err.field, err.too_large, err.code) == ("prompt", True, "request_too_large")
    assert "max_prompt_bytes" in err.message
    err = _refusal(front, FrontRequest("r", SamplingParams(), Prompt(text="\ud800")))
    assert (err.field, err.too_large) == ("prompt", False) and "lone surrogate" in err.message
    err = _refusal(front, FrontRequest("r", SamplingParams(), Prompt(text="hi " * 300)))
    assert err.field == "prompt" and f"max_model_len is {MAX_LEN}" in err.message
    with pytest.raises(InvalidRequest, match=r"request_id has 257 characters; the limit is 256 "
                                             r"\(max_request_id_chars\)"):
        front.check_request_id("x" * 257)
    with pytest.raises(InvalidRequest, match=r"\(max_stop_token_ids\)"):
        front.check_stop_token_ids(257)
    err = _refusal(front, FrontRequest("r", SamplingParams()))
    assert (err.field, err.message) == ("input", "input: give either text or token_ids")


@pytest.mark.parametrize("params, field", [
    (SamplingParams(temperature=-1.0), "temperature"), (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(max_tokens=MAX_LEN), "max_tokens"), (SamplingParams(max_tokens=MAX_LEN - 2), "prompt"),
    (SamplingParams(min_tokens=20), "min_tokens"), (SamplingParams(seed=-1), "seed"),
    (SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"), (SamplingParams(logprobs=21), "logprobs")])
def test_sampling_validation_names_the_field(front: RequestFront, params: SamplingParams, field: str) -> None:
    err = _refusal(front, FrontRequest("r", params, Prompt(token_ids=[1, 2, 3])))
    assert err.field == field and err.code is None, err.message
    # the same mistake in a chat request: fields the engine names keep their name
    chat = _refusal(front, FrontRequest("r", params, messages=CHAT))
    assert chat.field == field


def test_out_of_vocabulary_prompt(front: RequestFront, tokenizer) -> None:
    err = _refusal(front, FrontRequest("r", SamplingParams(), Prompt(token_ids=[tokenizer.vocab_size + 5])))
    assert err.field == "prompt" and "outside the vocabulary" in err.message


def test_chat_rendering(front: RequestFront, tokenizer) -> None:
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = tokenizer.encode(text, add_special_tokens=False)
    ready = _prepare(front, FrontRequest("r", SamplingParams(max_tokens=4), messages=CHAT))
    assert ready.prompt == expected and ready.params.max_tokens == 4
    rest = _prepare(front, FrontRequest("r", SamplingParams(), messages=CHAT, max_tokens_given=False))
    assert rest.params.max_tokens == MAX_LEN - len(expected)   # chat without max_tokens: the rest of the context
    bare = _prepare(front, FrontRequest("r", SamplingParams(), messages=CHAT, add_generation_prompt=False))
    assert bare.prompt == tokenizer.encode(tokenizer.apply_chat_template(CHAT, tokenize=False,
                                                                         add_generation_prompt=False),
                                           add_special_tokens=False)


def test_chat_template_failures_are_the_requests(front: RequestFront) -> None:
    err = _refusal(front, FrontRequest("r", SamplingParams(), messages=[{"role": "user", "content": "x" * 2000}]))
    assert (err.field, err.too_large) == ("messages", True)
    no_template = RequestFront(type("T", (), {"chat_template": None})(), 100, RequestLimits(), lambda: MAX_LEN, "m")
    err = _refusal(no_template, FrontRequest("r", SamplingParams(), messages=CHAT))
    assert (err.field, err.code) == ("messages", "no_chat_template") and "model m has no chat template" in err.message


def test_prepare_leaves_the_callers_params_alone(front: RequestFront) -> None:
    params = SamplingParams(stop_token_ids=[3])
    ready = _prepare(front, FrontRequest("r", params, messages=CHAT, max_tokens_given=False))
    ready.params.stop_token_ids.append(4)
    assert params == SamplingParams(stop_token_ids=[3])


def test_tokenizing_runs_off_the_event_loop(tokenizer) -> None:
    threads = []

    class Recording:
        chat_template = tokenizer.chat_template

        def encode(self, *args, **kwargs):
            threads.append(threading.current_thread())
            return tokenizer.encode(*args, **kwargs)

        def apply_chat_template(self, *args, **kwargs):
            threads.append(threading.current_thread())
            return tokenizer.apply_chat_template(*args, **kwargs)

    front = RequestFront(Recording(), tokenizer.vocab_size, RequestLimits(), lambda: MAX_LEN)
    _prepare(front, FrontRequest("r", SamplingParams(), Prompt(text="hello")))
    _prepare(front, FrontRequest("r", SamplingParams(), messages=CHAT))
    assert len(threads) == 3 and all(t is not threading.main_thread() for t in threads)
    assert {t.name.split("_")[0] for t in threads} == {"tokenize"}


@pytest.mark.parametrize("sampling", [   # values float32 holds exactly (the proto's type)
    {}, {"temperature": 0.5, "top_p": 0.75, "top_k": 7, "max_tokens": 5, "seed": 11, "stop_token_ids": [3, 4],
         "ignore_eos": True, "min_tokens": 2, "logprobs": 1, "cache_salt": "salt"}])
@pytest.mark.parametrize("prompt", ["Once upon a time", [5, 6, 7, 8]])
def test_grpc_and_http_give_the_same_request(front: RequestFront, sampling: dict, prompt) -> None:
    body = {"prompt": prompt, **sampling}
    http = front_requests(parse_body(body, chat=False, default_model="m"), "rid")
    assert len(http) == 1
    params = params_to_proto(SamplingParams(**sampling))
    for name in ("temperature", "top_p", "top_k", "max_tokens", "ignore_eos"):   # unset: the engine's defaults
        if name not in sampling:
            params.ClearField(name)
    grpc_request = router_pb2.GenerateRequest(request_id="rid", params=params)
    if isinstance(prompt, str):
        grpc_request.text = prompt
    else:
        grpc_request.token_ids.ids.extend(prompt)
    grpc = front_request(grpc_request, front)
    assert _prepare(front, grpc) == _prepare(front, http[0])
    assert _prepare(front, grpc).params.max_tokens == sampling.get("max_tokens", SamplingParams().max_tokens)


def test_unset_proto_fields_take_the_engine_defaults() -> None:
    assert params_from_proto(common_pb2.SamplingParams()) == SamplingParams()


def test_the_doors_map_refusals_to_their_protocols(front: RequestFront) -> None:
    too_big = InvalidRequest("prompt has 2000 bytes; the limit is 1000 (max_prompt_bytes)", "prompt",
                             "request_too_large", too_large=True)
    assert HTTPError.from_invalid(too_big).body() == {"error": {
        "message": too_big.message, "type": "invalid_request_error", "param": "prompt", "code": "request_too_large"}}
    assert HTTPError.from_invalid(too_big).status == 413
    bad = _refusal(front, FrontRequest("r", SamplingParams(temperature=-1.0), Prompt(token_ids=[1])))
    err = HTTPError.from_invalid(bad)
    assert (err.status, err.param, err.code) == (400, "temperature", None)
    with pytest.raises(HTTPError) as info:   # parse_body's own counts: the same messages as gRPC's
        parse_body({"prompt": "x", "stop_token_ids": list(range(300))}, chat=False, default_model="m")
    with pytest.raises(InvalidRequest) as grpc_info:
        front.check_stop_token_ids(300)
    assert info.value.message == grpc_info.value.message and info.value.param == "stop_token_ids"
