"""vLLM's /tokenize and /detokenize (services/api/tokenize_endpoints.py) on a real HTTP server in this
process, over the real request front and the tiny model's tokenizer, with no workers: the tokens,
the chat template's, the round trip, and every refusal naming its field. The same against a
deployment (and `vllm bench serve`'s use of them): tests/e2e/test_openai_api.py."""
from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.services.api.http_server import start_http
from pdserve.services.api.openai_protocol import HTTPError
from pdserve.services.api.request_front import RequestFront, TokenizeRequest
from pdserve.services.api.request_limits import RequestLimits
from pdserve.services.api.tokenize_endpoints import parse_detokenize, parse_tokenize
from pdserve.services.router.admission import PendingGate

KEY = "tokenize-test-key-0123456789"
MAX_LEN = 64
LIMITS = RequestLimits(max_prompt_bytes=2000, max_pending_requests=4)
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me a story."}]


class Facade:
    """The RouterFacade members the two endpoints use, over a real request front."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.limits = LIMITS
        self.max_model_len = MAX_LEN
        self.front = RequestFront(tokenizer, len(tokenizer), LIMITS, lambda: MAX_LEN, "m")
        self.gate = PendingGate(LIMITS.max_pending_requests)
        self.serving, self.draining = True, False

    def receiving(self):
        return self.gate.hold()

    async def tokenize(self, request: TokenizeRequest):
        return await self.front.tokenize(request)

    async def detokenize(self, token_ids):
        return await self.front.detokenize(token_ids)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: str):
    return load_tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def base(tokenizer) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start_http(Facade(tokenizer), "127.0.0.1", 0, ["m", "m2"],
                                                         api_key=KEY), loop).result(30)
    yield f"http://127.0.0.1:{server.port}"
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def post(base: str, path: str, body: dict | bytes, key: str | None = KEY,
         content_type: str = "application/json") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="POST", headers={"Content-Type": content_type})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def refusal(base: str, path: str, body: dict | bytes, **kw) -> tuple[int, str | None, str]:
    status, out = post(base, path, body, **kw)
    return status, out["error"]["param"], out["error"]["message"]


def test_prompt_tokens_are_the_tokenizers(base: str, tokenizer) -> None:
    text = "Once upon a time, héllo"
    status, out = post(base, "/tokenize", {"model": "m", "prompt": text})
    assert status == 200 and out["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_LEN and out["token_strs"] is None
    status, out = post(base, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert status == 200 and out["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert post(base, "/tokenize", {"model": "m2", "prompt": text})[0] == 200   # every served name


def test_chat_tokens_are_the_chat_templates(base: str, tokenizer) -> None:
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    status, out = post(base, "/tokenize", {"messages": CHAT})
    assert status == 200 and out["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    plain = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    status, out = post(base, "/tokenize", {"messages": CHAT, "add_generation_prompt": False,
                                           "add_special_tokens": True})
    assert status == 200 and out["tokens"] == tokenizer.encode(plain, add_special_tokens=True)
    open_end = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    status, out = post(base, "/tokenize", {"messages": open_end, "continue_final_message": True})
    text = tokenizer.decode(out["tokens"])
    assert status == 200 and text.endswith("Once upon"), text   # the last message left open


def test_detokenize_round_trips(base: str, tokenizer) -> None:
    text = "Once upon a time, héllo"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert post(base, "/detokenize", {"model": "m", "tokens": ids}) == (200, {"prompt": text})
    assert post(base, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})
    special = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    assert post(base, "/detokenize", {"tokens": [special]})[1]["prompt"] == tokenizer.eos_token   # kept


def test_refusals_name_the_field(base: str, tokenizer) -> None:
    vocab = len(tokenizer)
    for body, param in (({}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": 5}, "prompt"),
                        ({"prompt": "a", "messages": CHAT}, "prompt"), ({"messages": []}, "messages"),
                        ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
                        ({"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
                         "continue_final_message"),
                        ({"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                        ({"prompt": "hello " * 200}, "prompt")):   # over max_model_len tokens
        status, got, message = refusal(base, "/tokenize", body)
        assert (status, got) == (400, param), (body, message)
    assert "max_model_len is 64" in refusal(base, "/tokenize", {"prompt": "hello " * 200})[2]
    status, got, message = refusal(base, "/tokenize", {"prompt": "x" * 3000})   # over max_prompt_bytes
    assert (status, got) == (413, "prompt") and "max_prompt_bytes" in message
    for tokens in ([vocab], [-1], [5, 10**30]):
        status, got, message = refusal(base, "/detokenize", {"tokens": tokens})
        assert (status, got) == (400, "tokens") and f"vocabulary of {vocab} tokens" in message, message
    for body in ({}, {"tokens": "12"}, {"tokens": [1, True]}, {"tokens": [1] * (MAX_LEN + 1)}):
        status, got, message = refusal(base, "/detokenize", body)
        assert (status, got) == (400, "tokens"), (body, message)
    assert "the limit is 64 (max_model_len)" in refusal(base, "/detokenize", {"tokens": [1] * 65})[2]


def test_the_generation_endpoints_guard(base: str) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        status, out = post(base, path, {**body, "model": "other"})
        assert status == 404 and out["error"]["code"] == "model_not_found"
        status, out = post(base, path, body, key=None)
        assert status == 401 and out["error"]["code"] == "invalid_api_key"
        status, out = post(base, path, body, content_type="text/plain")
        assert status == 415
        assert post(base, path, b"{not json")[0] == 400


def test_parsers_without_a_server() -> None:
    model, req = parse_tokenize({"prompt": "hi"}, "m", LIMITS)
    assert model == "m" and req == TokenizeRequest(prompt="hi")
    _, req = parse_tokenize({"messages": CHAT, "continue_final_message": True}, "m", LIMITS)
    assert (req.add_generation_prompt, req.continue_final_message, req.add_special_tokens) == (False, True, False)
    with pytest.raises(HTTPError) as info:
        parse_detokenize({"tokens": list(range(10))}, "m", 9)   # counted before it is scanned
    assert info.value.param == "tokens" and "the limit is 9" in info.value.message
