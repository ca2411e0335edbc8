"""The router's OpenAI-compatible HTTP API: the real `openai` client against real processes
(router + workers, disaggregated and colocated), plus the pieces that need no cluster."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from types import SimpleNamespace

import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.services.api.detokenizer import IncrementalDetokenizer, StopMatcher
from pdserve.services.api.openai_protocol import HTTPError, parse_body
from pdserve.services.api.request_front import RequestFront
from pdserve.services.api.request_limits import InvalidRequest, RequestLimits
from pdserve.services.deployment.launcher import Cluster, free_port
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import random_prompts
from tests.serving import (TEST_ENGINE_ARGS, assert_blocks_at_baseline, channel, frozen, metric, start_cluster,
    wait_for, workers)

API_KEY = "openai-test-key-0123456789"
MAX_NEW = 10
PROMPTS = random_prompts(4, 5, 40, seed=47)
TEXT_PROMPT = "Once upon a time"
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me a story."}]


# ---- pieces without a cluster ---------------------------------------------------------------

def test_stop_matcher_across_boundaries_and_hold_back() -> None:
    m = StopMatcher(["STOP", "xy"])
    assert m.add("abc S", False) == ("abc ", False)     # "S" could start STOP: held back
    assert m.add("T", False) == ("", False)
    assert m.add("OP tail", False) == ("", True)        # matched across three pieces; nothing of it sent
    m = StopMatcher(["STOP"])
    assert m.add("ab ST", False) == ("ab ", False)
    assert m.add("X", False) == ("STX", False)          # not a stop after all: sent
    assert m.add("S", True) == ("S", False)             # the end flushes what was held
    m = StopMatcher(["bc", "ab"])
    assert m.add("zabc", False) == ("z", True)          # the earliest match wins
    m = StopMatcher(["ab"])
    assert m.add("ab", False, check=False) == ("ab", False)   # before min_tokens: no stop
    assert StopMatcher([]).add("anything", False) == ("anything", False)


def test_request_guard_without_a_server() -> None:
    from pdserve.services.api.http_connections import RequestGuard

    def scope(host: str = "localhost:8000", content_type: str = "application/json", auth: str | None = None,
              path: str = "/v1/completions") -> dict:
        headers = [(b"host", host.encode()), (b"content-type", content_type.encode())]
        if auth is not None:
            headers.append((b"authorization", auth.encode()))
        return {"type": "http", "method": "POST", "path": path, "headers": headers}

    open_guard = RequestGuard(None, "models.example")
    assert open_guard.refusal(scope()) is None and open_guard.refusal(scope("[::1]:80")) is None
    assert open_guard.refusal(scope("Models.Example.:80")) is None and open_guard.refusal(scope("10.0.0.1")) is None
    assert open_guard.refusal(scope("evil.example")).status == 421
    assert open_guard.refusal(scope(content_type="text/plain")).status == 415
    assert open_guard.refusal(scope(content_type="text/plain", path="/v1/models")) is None
    keyed = RequestGuard(API_KEY, None)
    assert keyed.refusal(scope("evil.example", auth=f"Bearer {API_KEY}")) is None   # the key is what counts
    assert keyed.refusal(scope(auth="Bearer wrong")).status == 401
    assert RequestGuard(None, "*").refusal(scope("any.example")) is None


def test_parse_body_names_the_field() -> None:
    cases = [({"prompt": "x", "temperature": "hot"}, "temperature"), ({"prompt": "x", "n": 0}, "n"),
             ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"prompt": "x", "stop": [""]}, "stop"),
             ({}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
             ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
             ({"prompt": "x", "presence_penalty": "lots"}, "presence_penalty"), ({"prompt": "x", "seed": True}, "seed"),
             ({"prompt": "x", "echo": "yes"}, "echo"), ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
             ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
             ({"prompt": "x", "best_of": 2}, "best_of"), ({"prompt": "x", "suffix": "y"}, "suffix"),
             ({"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
             ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
             ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
             ({"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
             ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
             ({"prompt": "x", "logprobs": 21}, "logprobs"), ({"prompt": "x", "logprobs": True}, "logprobs")]
    for body, param in cases:
        with pytest.raises(HTTPError) as info:
            parse_body(body, chat=False, default_model="m")
        assert (info.value.status, info.value.param) == (400, param), body
    with pytest.raises(HTTPError) as info:
        parse_body({"messages": [{"content": "no role"}]}, chat=True, default_model="m")
    assert info.value.param == "messages"
    # unknown fields are ignored; neutral values of unsupported ones are accepted; vLLM's extras parse
    p = parse_body({"prompt": [[1, 2], [3]], "some_future_field": {"x": 1}, "presence_penalty": 0, "top_k": -1,
                    "repetition_penalty": 1.0, "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [5],
                    "max_tokens": 7, "user": "u"}, chat=False, default_model="m")
    assert [q.token_ids for q in p.prompts] == [[1, 2], [3]] and p.model == "m"
    assert (p.params.top_k, p.params.ignore_eos, p.params.min_tokens, p.params.stop_token_ids,
            p.params.max_tokens) == (0, True, 2, [5], 7)
    c = parse_body({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                    "max_completion_tokens": 3, "max_tokens": 9}, chat=True, default_model="m")
    assert c.messages[0]["content"] == "hi" and c.params.max_tokens == 3 and c.params.logprobs is None
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_body({**chat, "logprobs": True, "top_logprobs": 2}, chat=True, default_model="m").params.logprobs == 2
    assert parse_body({**chat, "logprobs": True}, chat=True, default_model="m").params.logprobs == 0
    with pytest.raises(HTTPError) as info:
        parse_body({**chat, "echo": True}, chat=True, default_model="m")
    assert (info.value.status, info.value.param) == (400, "echo")
    # echo scores the prompt with logprobs' alternatives; max_tokens=0 generates one token, not shown
    scored = parse_body({"prompt": [1, 2, 3], "echo": True, "logprobs": 2, "max_tokens": 0}, chat=False,
                        default_model="m")
    assert (scored.echo, scored.echo_only, scored.params.max_tokens, scored.params.prompt_logprobs,
            scored.prompt_logprobs) == (True, True, 1, 2, None)
    both = parse_body({"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 4}, chat=False, default_model="m")
    assert (both.echo_only, both.params.max_tokens, both.params.prompt_logprobs, both.prompt_logprobs) == \
        (False, 16, 4, 4)
    assert parse_body({"prompt": "x", "echo": True}, chat=False, default_model="m").params.prompt_logprobs is None
    assert parse_body({"prompt": "x", "logprobs": 0}, chat=False, default_model="m").params.logprobs == 0
    for body in ({**chat, "top_logprobs": 2}, {**chat, "logprobs": True, "top_logprobs": 21}):
        with pytest.raises(HTTPError) as info:
            parse_body(body, chat=True, default_model="m")
        assert info.value.param == "top_logprobs"


def test_detokenizer_never_splits_a_multibyte_character(tiny_qwen3: str) -> None:
    tok = load_tokenizer(tiny_qwen3)
    text = "naïve café — 日本語 🙂 Ünïcödé ✓"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs a character split across tokens"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i], final=k == len(ids) - 1) for k, i in enumerate(ids)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_min_tokens_keeps_stop_ids_out_until_reached(tiny_qwen3: str) -> None:
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=128)
    prompt = PROMPTS[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    stop = greedy[2]
    first = greedy.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))[0]
    assert (out.token_ids, out.finish_reason) == (greedy[:first + 1], "stop")
    # as vLLM: stop ids (and EOS) cannot be sampled before min_tokens; before that, nothing changes
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop], min_tokens=first + 2))[0]
    assert out.token_ids[:first] == greedy[:first] and out.token_ids[first] != stop
    assert stop not in out.token_ids[:first + 2]
    assert out.finish_reason == "length" or (out.token_ids[-1] == stop and len(out.token_ids) > first + 2)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4).validate()


def test_engine_logprobs_are_the_raw_model_distribution(tiny_qwen3: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=128)
    prompt = PROMPTS[1]
    greedy, sampled = llm.generate([prompt, prompt], [_greedy(4, logprobs=5),
                                                      SamplingParams(temperature=2.0, seed=3, max_tokens=4, logprobs=0)])
    assert len(greedy.logprobs) == 4 and len(sampled.logprobs) == 4
    for tok, lp in zip(greedy.token_ids, greedy.logprobs):
        assert lp.top_ids[0] == tok and lp.top_logprobs[0] == pytest.approx(lp.logprob)
        assert len(lp.top_ids) == 5 and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert all(lp.top_ids == [] for lp in sampled.logprobs)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt + greedy.token_ids[:1]])).logits[0, -2:].float(), -1)
    top = ref[0].topk(5)
    assert greedy.logprobs[0].top_ids == top.indices.tolist()
    assert greedy.logprobs[0].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-3)
    assert greedy.logprobs[1].logprob == pytest.approx(ref[1, greedy.token_ids[1]].item(), abs=1e-3)
    # sampled at temperature 2, reported from the raw distribution (vLLM's default, raw_logprobs)
    assert sampled.logprobs[0].logprob == pytest.approx(ref[0, sampled.token_ids[0]].item(), abs=1e-3)
    assert llm.generate([prompt], _greedy(2))[0].logprobs is None


def test_chat_without_template_is_a_clear_400(tiny_qwen3: str) -> None:
    import asyncio
    front = RequestFront(SimpleNamespace(chat_template=None), 1024, RequestLimits(), lambda: 64, "m")
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(front.render_chat(CHAT, True))
    err = HTTPError.from_invalid(info.value)
    assert (err.status, err.param, err.code) == (400, "messages", "no_chat_template")


def test_https_with_the_router_certificate(tmp_path) -> None:
    import asyncio
    import datetime
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from pdserve.services.api.http_server import start_http
    from pdserve.services.common.security import TLSFiles

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    tls = TLSFiles(tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "cert.pem")
    router = SimpleNamespace(serving=True, draining=False)   # the RouterFacade members /health and /version use
    ctx = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))

    def get(port: int, path: str, key: str | None = None) -> int:
        req = urllib.request.Request(f"https://localhost:{port}{path}")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            return urllib.request.urlopen(req, context=ctx, timeout=10).status
        except urllib.error.HTTPError as e:
            return e.code

    async def run() -> tuple[str, int, int, int]:
        server = await start_http(router, "127.0.0.1", 0, "m", api_key=API_KEY, tls=tls)
        try:
            loop = asyncio.get_running_loop()
            return (server.scheme, await loop.run_in_executor(None, get, server.port, "/health"),
                    await loop.run_in_executor(None, get, server.port, "/version"),
                    await loop.run_in_executor(None, get, server.port, "/version", API_KEY))
        finally:
            await server.stop()

    assert asyncio.run(run()) == ("https", 200, 401, 200)


def test_up_forwards_router_settings(monkeypatch, tiny_qwen3: str) -> None:
    import pdserve.services.deployment.launcher
    from pdserve.services.cli.commands import main

    seen = {}

    class FakeCluster:
        def __init__(self, spec):
            seen["spec"] = spec

        def request_stop(self, *_):
            pass

        def start(self, **kwargs):
            raise pdserve.services.deployment.launcher.Stopped()

    monkeypatch.setattr(pdserve.services.deployment.launcher, "Cluster", FakeCluster)   # cmd_up imports it when it runs
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    assert main(["up", "--model", tiny_qwen3, "--port", str(free_port()), "--http-port", "8123",
                 "--served-model-name", "tiny", "--max-choices", "8", "--drain-timeout-s", "7"]) == 0
    argv = seen["spec"].router_args
    assert argv[argv.index("--http-port") + 1] == "8123" and argv[argv.index("--served-model-name") + 1] == "tiny"
    assert argv[argv.index("--max-choices") + 1] == "8"
    assert "--drain-timeout-s" not in argv and seen["spec"].drain_timeout_s == 7.0   # up's own, set by the launcher


# ---- clusters ------------------------------------------------------------------------------

@dataclass
class Served:
    cluster: Cluster
    base: str                 # http://127.0.0.1:PORT
    api_key: str | None
    model: str                # served model name

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=self.api_key or "unused", timeout=120, **kwargs)

    def get(self, path: str, key: str | None = None, headers: dict | None = None) -> tuple[int, bytes, dict]:
        req = urllib.request.Request(self.base + path, headers=headers or {})
        key = key if key is not None else self.api_key
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def post(self, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.base + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def router_metrics(self) -> dict[str, float]:
        status, text, _ = self.get("/metrics")
        assert status == 200
        out = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                out[series] = float(value)
        return out


def _serve(model: str, router_args=(), api_key: str | None = None, **kwargs) -> Served:
    port = free_port()
    old = os.environ.get("PDSERVE_API_KEY")
    if api_key:
        os.environ["PDSERVE_API_KEY"] = api_key   # the router reads it from its environment, as under `up`
    try:
        cluster = start_cluster(model, router_args=["--http-port", str(port), *router_args], **kwargs)
    finally:
        if api_key:
            if old is None:
                os.environ.pop("PDSERVE_API_KEY", None)
            else:
                os.environ["PDSERVE_API_KEY"] = old
    return Served(cluster, f"http://127.0.0.1:{port}", api_key, model)   # vLLM's name: --model as given


@pytest.fixture(scope="module")
def disagg(tiny_qwen3: str):
    served = _serve(tiny_qwen3, api_key=API_KEY, prefill_workers=1, decode_workers=1)
    yield served
    served.cluster.stop()


@pytest.fixture(scope="module")
def coloc(tiny_qwen3: str):
    served = _serve(tiny_qwen3, colocated_workers=1)
    yield served
    served.cluster.stop()


@pytest.fixture(params=["disagg", "coloc"])
def served(request) -> Served:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def offline(tiny_qwen3: str) -> LLM:
    return LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512)


def _greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---- completions ---------------------------------------------------------------------------

def test_completions_greedy_matches_offline(served: Served, offline: LLM) -> None:
    client = served.client()
    ref = offline.generate(PROMPTS, _greedy())
    out = client.completions.create(model=served.model, prompt=PROMPTS, max_tokens=MAX_NEW, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == served.model
    assert [c.index for c in out.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in out.choices] == [r.text for r in ref]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert out.usage.completion_tokens == MAX_NEW * len(PROMPTS)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # one token-id prompt, one text prompt, a batch of texts
    one = client.completions.create(model=served.model, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == ref[1].text
    # PROMPTS[1] again: its blocks, computed for the batch, are in the prefix cache of whichever worker
    # prefills it now; cached are its full blocks, never its last token (engine/kv/block_manager.allocate)
    block_size = int(TEST_ENGINE_ARGS[TEST_ENGINE_ARGS.index("--block-size") + 1])
    held = (len(PROMPTS[1]) - 1) // block_size * block_size
    assert one.usage.prompt_tokens_details.cached_tokens == held > 0, (one.usage, held)
    text_ref = offline.generate([TEXT_PROMPT, "Hello"], _greedy())
    texts = client.completions.create(model=served.model, prompt=[TEXT_PROMPT, "Hello"], max_tokens=MAX_NEW,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in texts.choices] == [r.text for r in text_ref]
    assert texts.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in text_ref)
    assert_blocks_at_baseline(served.cluster)


def test_streaming_completion(served: Served, offline: LLM) -> None:
    ref = offline.generate([TEXT_PROMPT], _greedy())[0]
    chunks = list(served.client().completions.create(
        model=served.model, prompt=TEXT_PROMPT, max_tokens=MAX_NEW, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert len(text_chunks) == MAX_NEW                  # one event per token
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (MAX_NEW - 1) + ["length"]
    assert all(c.usage is None for c in text_chunks)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == MAX_NEW
    assert usage.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert len({c.id for c in chunks}) == 1


def test_n_choices_with_seed(served: Served, offline: LLM) -> None:
    client = served.client()
    out = client.completions.create(model=served.model, prompt=PROMPTS[2], n=2, seed=11, temperature=1.0,
                                    max_tokens=MAX_NEW, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    ref = offline.generate([PROMPTS[2]] * 2, [SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True,
                                                             seed=11 + i) for i in range(2)])
    assert [c.text for c in out.choices] == [r.text for r in ref]    # choice i samples with seed + i
    assert out.usage.prompt_tokens == len(PROMPTS[2]) and out.usage.completion_tokens == 2 * MAX_NEW
    events = list(client.completions.create(model=served.model, prompt=PROMPTS[2], n=2, seed=11, temperature=1.0,
                                            max_tokens=MAX_NEW, stream=True, extra_body={"ignore_eos": True}))
    for i in range(2):
        assert "".join(e.choices[0].text for e in events if e.choices[0].index == i) == ref[i].text
    assert sum(1 for e in events if e.choices[0].finish_reason == "length") == 2


def _stop_case(offline: LLM, prompt: list[int]) -> tuple[str, str, int]:
    """A stop string that spans a token boundary of the greedy output: (stop, text before it,
    tokens generated when it is complete)."""
    tok = offline.tokenizer
    ids = offline.generate([prompt], _greedy(40))[0].token_ids
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([t]) for t in ids]
    for k in range(3, len(deltas) - 1):
        a, b = deltas[k], deltas[k + 1]
        if len(a) >= 2 and len(b) >= 2 and (a + b).isascii():
            stop = a[-2:] + b[:2]
            break
    else:
        pytest.skip("no ASCII token boundary in the greedy output")
    text, n = "", 0
    for n, d in enumerate(deltas, 1):
        text += d
        if stop in text:
            break
    return stop, text[:text.index(stop)], n


def test_stop_strings(served: Served, offline: LLM) -> None:
    client = served.client()
    prompt = PROMPTS[3]
    stop, before, n_tokens = _stop_case(offline, prompt)
    out = client.completions.create(model=served.model, prompt=prompt, max_tokens=40, temperature=0,
                                    stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    assert (out.choices[0].text, out.choices[0].finish_reason) == (before, "stop")
    assert out.usage.completion_tokens == n_tokens
    events = list(client.completions.create(model=served.model, prompt=prompt, max_tokens=40, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(e.choices[0].text for e in events) == before
    assert events[-1].choices[0].finish_reason == "stop"
    assert all(stop not in e.choices[0].text for e in events)
    assert_blocks_at_baseline(served.cluster)    # stopped early: aborted on its workers, blocks freed


def test_stop_token_ids_and_min_tokens(served: Served, offline: LLM) -> None:
    greedy = offline.generate([PROMPTS[0]], _greedy(20))[0].token_ids
    stop = greedy[2]
    first = greedy.index(stop)
    out = served.client().completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                             extra_body={"stop_token_ids": [stop], "min_tokens": first + 2})
    ref = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop],
                                                        min_tokens=first + 2))[0]   # stop ids masked until then
    assert out.usage.completion_tokens == len(ref.token_ids) and out.choices[0].finish_reason == ref.finish_reason


def test_logprobs(served: Served, offline: LLM) -> None:
    client = served.client()
    prompt = PROMPTS[2]
    ref = offline.generate([prompt], _greedy(logprobs=3))[0]
    tok = offline.tokenizer
    out = client.completions.create(model=served.model, prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx([r.logprob for r in ref.logprobs], abs=1e-3)
    for top, r, text in zip(lp.top_logprobs, ref.logprobs, lp.tokens):
        assert set(top) >= {tok.decode([i]) for i in r.top_ids} and text in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    events = list(client.completions.create(model=served.model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                            logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    assert [x for e in events for x in e.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert [x for e in events for x in e.choices[0].logprobs.text_offset] == lp.text_offset
    chat = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)   # greedy: the top one
    assert "".join(c.token for c in content) == chat.choices[0].message.content or "\ufffd" in chat.choices[0].message.content
    plain = client.completions.create(model=served.model, prompt=prompt, max_tokens=2)
    assert plain.choices[0].logprobs is None


# ---- chat ---------------------------------------------------------------------------------

def test_chat_completions_match_offline(served: Served, offline: LLM) -> None:
    tok = offline.tokenizer
    prompt = tok.encode(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    ref = offline.generate([prompt], _greedy())[0]
    client = served.client()
    out = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    msg = out.choices[0].message
    assert (msg.role, msg.content, out.choices[0].finish_reason) == ("assistant", ref.text, "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), MAX_NEW)
    chunks = list(client.chat.completions.create(
        model=served.model, messages=CHAT, max_completion_tokens=MAX_NEW, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == len(prompt) and chunks[-1].usage.completion_tokens == MAX_NEW


# ---- vLLM's /tokenize and /detokenize ------------------------------------------------------------

# `vllm bench serve`'s check of its tokenizer against the server's, run by vLLM's own code in its
# virtualenv (bench/vs_vllm.py's VLLM_PYTHON_ENV): prompt_len deliberately short, so it re-aligns
ALIGN_WITH_VLLM = """
import asyncio, json, sys
from vllm.benchmarks.datasets import SampleRequest
from vllm.benchmarks.serve import _align_prompts_to_server_tokenizer
base, model, prompt, n = sys.argv[1:5]
out = asyncio.run(_align_prompts_to_server_tokenizer(base, model, [SampleRequest(prompt, int(n), 4)]))
print(json.dumps({"prompt": out[0].prompt, "prompt_len": out[0].prompt_len}))
"""


def test_tokenize_matches_the_tokenizer_and_the_chat_endpoint(disagg: Served, tiny_qwen3: str) -> None:
    tok = load_tokenizer(tiny_qwen3)
    for special in (True, False):
        status, out = disagg.post("/tokenize", json.dumps({"model": disagg.model, "prompt": TEXT_PROMPT,
                                                           "add_special_tokens": special}).encode())
        assert status == 200 and out["tokens"] == tok.encode(TEXT_PROMPT, add_special_tokens=special)
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 2048 and out["token_strs"] is None
    status, out = disagg.post("/tokenize", json.dumps({"prompt": TEXT_PROMPT, "return_token_strs": True}).encode())
    assert status == 200 and out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    status, chat = disagg.post("/tokenize", json.dumps({"model": disagg.model, "messages": CHAT}).encode())
    usage = disagg.client().chat.completions.create(model=disagg.model, messages=CHAT, max_tokens=1).usage
    assert status == 200 and chat["count"] == usage.prompt_tokens
    status, out = disagg.post("/detokenize", json.dumps({"model": disagg.model, "tokens": chat["tokens"]}).encode())
    assert status == 200 and out["prompt"] == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_tokenize_refusals_and_its_api_key(disagg: Served) -> None:
    def refused(path: str, body: dict) -> tuple[int, str | None, str]:
        status, out = disagg.post(path, json.dumps(body).encode())
        return status, out["error"]["param"], out["error"]["message"]

    status, param, message = refused("/detokenize", {"tokens": [1, 1024]})
    assert (status, param) == (400, "tokens") and "vocabulary of 1024 tokens" in message
    assert refused("/tokenize", {"model": disagg.model})[:2] == (400, "prompt")
    status, param, message = refused("/tokenize", {"prompt": "hello " * 3000})   # past max_model_len
    assert (status, param) == (400, "prompt") and "max_model_len is 2048" in message
    with pytest.raises(openai.BadRequestError) as info:   # the completions endpoint's own refusal
        disagg.client(max_retries=0).completions.create(model=disagg.model, prompt="hello " * 3000, max_tokens=1)
    assert info.value.body["message"] == message
    status, param, message = refused("/detokenize", {"tokens": [1] * 2049})
    assert (status, param) == (400, "tokens") and "limit is 2048 (max_model_len)" in message
    assert disagg.post("/tokenize", json.dumps({"model": "no-such-model", "prompt": "x"}).encode())[1][
        "error"]["code"] == "model_not_found"
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        req = urllib.request.Request(disagg.base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:   # no API key
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 401


def test_vllm_bench_serve_aligns_its_prompts_with_tokenize(coloc: Served, tiny_qwen3: str) -> None:
    python = os.environ.get("PDSERVE_VLLM_PYTHON")
    if not python or not os.path.exists(python):
        pytest.skip("no vLLM virtualenv (PDSERVE_VLLM_PYTHON)")
    tok = load_tokenizer(tiny_qwen3)
    prompt = "Once upon a time there was a tiny model that told stories"
    ids = tok.encode(prompt, add_special_tokens=False)
    out = subprocess.run([python, "-c", ALIGN_WITH_VLLM, coloc.base, coloc.model, prompt, "5"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "unavailable" not in out.stdout and "re-aligning prompts" in out.stdout, out.stdout
    assert len(ids) > 5 and json.loads(out.stdout.splitlines()[-1]) == {"prompt": tok.decode(ids[:5]), "prompt_len": 5}


# ---- disconnects ---------------------------------------------------------------------------

def _idle_router_metrics(served: Served) -> dict:
    """The router's metrics once no request is in flight (a request still finishing would count
    its success later, inside the caller's window)."""
    deadline = time.monotonic() + 60
    while metric(served.router_metrics(), "pdserve:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    return served.router_metrics()


def test_disconnect_mid_stream_frees_blocks(served: Served) -> None:
    before = _idle_router_metrics(served)
    host, port = served.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": served.model, "prompt": PROMPTS[0], "max_tokens": 2000 - len(PROMPTS[0]),
                       "temperature": 0, "ignore_eos": True, "stream": True})
    headers = {"Content-Type": "application/json"}
    if served.api_key:
        headers["Authorization"] = f"Bearer {served.api_key}"
    conn.request("POST", "/v1/completions", body, headers)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = 0
    while events < 3:   # the request is generating
        if resp.readline().startswith(b"data: "):
            events += 1
    # Its workers frozen while the client goes: a starved client would otherwise find the whole
    # stream sent (nothing left to cancel) by the time it disconnects. The router stays running.
    workers = [p.popen.pid for p in served.cluster.processes if p.name != "router"]
    with frozen(workers):
        conn.sock.shutdown(2)
        conn.close()
        # the router sees the disconnect and ends the request meanwhile (its aborts on the workers
        # run in the background): no longer running, counted as a failure
        failures = metric(before, "pdserve:request_failure_total")

        def ended() -> bool:
            now = served.router_metrics()
            return (metric(now, "pdserve:num_requests_running") == 0
                    and metric(now, "pdserve:request_failure_total") == failures + 1)
        wait_for(ended, 30, "the router to end the disconnected request", interval=0.05)
    assert_blocks_at_baseline(served.cluster, timeout=60)
    after = _idle_router_metrics(served)
    # it was cancelled, not run to its end
    assert metric(after, "pdserve:request_success_total") == metric(before, "pdserve:request_success_total")
    assert metric(after, "pdserve:request_failure_total") == metric(before, "pdserve:request_failure_total") + 1


# ---- endpoints, auth, errors ------------------------------------------------------------------

def test_models_health_version_metrics(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [served.model]
    assert served.get("/health", key="")[0] == 200          # open, even with an API key
    status, body, _ = served.get("/version")
    assert status == 200 and json.loads(body)["version"]
    status, body, _ = served.get("/metrics")
    assert status == 200 and b"pdserve:generation_tokens_total" in body


def test_idle_keep_alive_connection_is_reused_after_client_pool_timeouts(disagg: Served) -> None:
    """A connection left idle for longer than a typical client pool's idle timeout (httpx 5 s,
    uvicorn's own default) still serves the next request: the client, not the server, closes
    idle connections, so a reuse never races the server's close ("Server disconnected")."""

    host, port = disagg.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for attempt in range(2):
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, attempt
            assert resp.getheader("connection", "").lower() != "close"
            if attempt == 0:
                sock = conn.sock
                time.sleep(6.0)   # kept: idle past a client pool's timeout (what is tested)
        assert conn.sock is sock    # the same TCP connection served both requests
    finally:
        conn.close()


def test_api_key(disagg: Served) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{disagg.base}/v1", api_key="wrong-key-0123456789", max_retries=0).completions.create(
            model=disagg.model, prompt="x", max_tokens=2)
    assert info.value.status_code == 401
    status, body, _ = disagg.get("/v1/models", key="")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, _, _ = disagg.get("/metrics", key="wrong-key-0123456789")
    assert status == 401
    status, _, _ = disagg.get("/v1/models", headers={"Host": "any.example"})   # with a key, any Host
    assert status == 200
    assert disagg.client().completions.create(model=disagg.model, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_unknown_model_is_404_and_bad_input_400(disagg: Served) -> None:
    client = disagg.client(max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    err = info.value.body
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "model_not_found"
    for kwargs, param in (({"temperature": -1.0}, "temperature"), ({"max_tokens": 5000}, "max_tokens"),
                          ({"max_tokens": 2047}, "prompt"), ({"extra_body": {"top_p": 0}}, "top_p")):
        with pytest.raises(openai.BadRequestError) as info:   # max_tokens past max_model_len (2048) alone: max_tokens
            client.completions.create(model=disagg.model, prompt="hello there, how are you", **kwargs)
        assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=disagg.model, prompt=[[1, 2], [1024 * 1024]], max_tokens=2)
    status, body = disagg.post("/v1/completions", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = disagg.post("/v1/nothing-here", b"{}")
    assert status == 404 and "error" in body


def test_cache_salt_separates_prefix_caches(served: Served) -> None:
    """Requests share cached KV only under the same cache_salt, disaggregated too (the salt enters
    the first block's chain hash on the router, the prefill and the decode worker alike)."""
    client = served.client()
    prompt = random_prompts(1, 48, 48, seed=77)[0]

    def cached(salt: str) -> int:
        out = client.completions.create(model=served.model, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": salt, "ignore_eos": True})
        assert out.usage.completion_tokens == 2
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") >= 40
    assert_blocks_at_baseline(served.cluster)


@pytest.fixture(scope="module")
def limits(tiny_qwen3: str):
    served = _serve(tiny_qwen3, router_args=["--max-queued-requests", "0", "--max-http-body-bytes", "65536",
                                             "--max-prompt-bytes", "4096", "--worker-wait-s", "0.5"],
                    prefill_workers=1, decode_workers=1)
    yield served
    served.cluster.stop()


def test_413_body_and_prompt_too_large(limits: Served) -> None:
    big = json.dumps({"model": limits.model, "prompt": "a" * 100_000}).encode()
    status, body = limits.post("/v1/completions", big)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # no Content-Length (chunked): the cap applies while the body is read
    host, port = limits.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", iter([big[i:i + 8192] for i in range(0, len(big), 8192)]),
                 {"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413
    conn.close()
    with pytest.raises(openai.APIStatusError) as info:
        limits.client(max_retries=0).completions.create(model=limits.model, prompt="b" * 5000, max_tokens=2)
    assert info.value.status_code == 413 and info.value.body["param"] == "prompt"


def _fill_decode_worker(served: Served) -> list[str]:
    """Reserve (directly on the decode worker) every block it will give: the router's requests
    then wait in its admission queue."""
    (decode,) = workers(served.cluster, "decode")
    ids, k = [], 0
    with channel(served.cluster, decode) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        for n in (2000, 1000, 500, 250, 120, 60, 30, 15, 7, 3, 1):
            while True:
                rid = f"filler-{k}"
                k += 1
                prompt = random_prompts(1, n, n, seed=1000 + k)[0]
                try:
                    stub.Reserve(worker_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                           params=common_pb2.SamplingParams(max_tokens=1),
                                                           lease_ms=120_000), timeout=10)
                except Exception:   # RESOURCE_EXHAUSTED: try a smaller one
                    break
                ids.append(rid)
    return ids


def test_429_when_the_admission_queue_is_full(limits: Served) -> None:
    fillers = _fill_decode_worker(limits)
    client = limits.client(max_retries=0)
    waiting: dict = {}
    thread = threading.Thread(target=lambda: waiting.setdefault("out", client.completions.create(
        model=limits.model, prompt=PROMPTS[0], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})))
    thread.start()
    deadline = time.monotonic() + 60
    while metric(limits.router_metrics(), "pdserve:num_requests_running") < 1:   # it waits in the queue
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=limits.model, prompt=PROMPTS[1], max_tokens=4)
        assert info.value.status_code == 429 and int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.body["type"] == "rate_limit_error"
        assert "max_queued_requests=0, set by --max-queued-requests" in info.value.body["message"]   # the limit
    finally:
        (decode,) = workers(limits.cluster, "decode")
        with channel(limits.cluster, decode) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            for rid in fillers:
                stub.Abort(common_pb2.AbortRequest(request_id=rid), timeout=10)
        thread.join(120)
    assert waiting["out"].usage.completion_tokens == 4     # the queued one went through once room was made
    assert_blocks_at_baseline(limits.cluster)


def test_503_without_a_decode_worker(limits: Served) -> None:
    # last test of the module: the decode worker is killed for good
    proc = next(p for p in limits.cluster.processes if p.name.startswith("decode"))
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait()
    deadline = time.monotonic() + 60
    while limits.get("/health")[0] != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with pytest.raises(openai.APIStatusError) as info:
        limits.client(max_retries=0).completions.create(model=limits.model, prompt=PROMPTS[0], max_tokens=4)
    assert info.value.status_code == 503 and info.value.body["code"] == "unavailable"
