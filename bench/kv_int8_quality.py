#!/usr/bin/env python
"""The int8 KV wire codec's effect on a real trained model (issue 23): greedy token agreement and
mean |Δ logprob| of a disaggregated deployment with ``--kv-compression int8`` against ``off``.

Model: llama2.c's stories260K (dim 64, 5 layers, 8 heads, 4 KV heads, vocab 512, trained on
TinyStories), read from its ``.bin`` and converted here to a Hugging Face Llama checkpoint
(float32 safetensors, config.json, a WordLevel tokenizer over 512 placeholder symbols: prompts
are token ids, the text is irrelevant). The converter permutes wq/wk rows as transformers'
convert_llama_weights_to_hf does (llama2.c rotates interleaved pairs, HF rotates halves).

Checks printed before measuring: transformers' logits (the oracle) against a float64 forward
written here from the ``.bin`` directly (llama2.c's run.c, its stored RoPE tables), and the
offline engine's greedy tokens against transformers' greedy generate.

Measurement: prompts sampled from the model itself (BOS=1, temperature 1, seeded, 64-400 tokens),
then for each codec in --codecs a real ``pdserve up`` (1 prefill + 1 decode worker, KV over the
gRPC stream: ``--no-kv-shared-memory``), one request at a time, greedy, ``ignore_eos``,
``logprobs=2`` (each token's logprob, and the top-2 margin that shows where greedy was near a
tie). Each codec's outputs are compared with ``off``'s: share of prompts with identical tokens,
first divergence position, mean |Δ logprob| over the aligned positions before it. The codecs'
bytes ratios on this model's real (float32) KV are measured offline from the engine's pool too.

Cross-check and baselines (--hf-variants): the same hand-off replayed in transformers, the
prompt's KV cache passed through the int8 codec, or rounded to bfloat16 / float16, between the
prefill (whose logits give the first token) and greedy decoding. Example::

    git --git-dir=/work/.mirror/plctlab+rvspoc-s2311-llama2/repo show fca8a35:stories260K.bin > /tmp/stories260K.bin
    PYTHONPATH=. python bench/kv_int8_quality.py --bin /tmp/stories260K.bin --out /tmp/kv_int8.json
"""
from __future__ import annotations

import json
import random
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402

HEADER = struct.Struct("<7i")
ROPE_THETA = 10000.0
RMS_EPS = 1e-5           # llama2.c's run.c
BOS, EOS = 1, 2          # llama2.c's sentencepiece ids


# --------------------------------------------------------------------------- llama2.c format
@dataclass(frozen=True, slots=True)
class L2CConfig:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool = True

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The file's float32 tensors in order, after the header."""
        L, d, h, kv = self.n_layers, self.dim, self.hidden_dim, self.kv_dim
        out = [("token_embedding", (self.vocab_size, d)), ("rms_att", (L, d)), ("wq", (L, d, d)),
               ("wk", (L, kv, d)), ("wv", (L, kv, d)), ("wo", (L, d, d)), ("rms_ffn", (L, d)),
               ("w1", (L, h, d)), ("w2", (L, d, h)), ("w3", (L, h, d)), ("rms_final", (d,)),
               ("freq_cis_real", (self.seq_len, self.head_size // 2)),
               ("freq_cis_imag", (self.seq_len, self.head_size // 2))]
        if not self.shared_classifier:
            out.append(("wcls", (self.vocab_size, d)))
        return out


def read_llama2c(path: str | Path) -> tuple[L2CConfig, dict[str, np.ndarray]]:
    """Header + float32 weights of a llama2.c checkpoint; ValueError if the sizes do not add up."""
    raw = Path(path).read_bytes()
    if len(raw) < HEADER.size:
        raise ValueError(f"{path}: {len(raw)} bytes, shorter than the {HEADER.size}-byte header")
    dim, hidden, layers, heads, kv_heads, vocab, seq = HEADER.unpack_from(raw)
    cfg = L2CConfig(dim, hidden, layers, heads, kv_heads, abs(vocab), seq, shared_classifier=vocab > 0)
    if min(dim, hidden, layers, heads, kv_heads, abs(vocab), seq) <= 0 or dim % heads or heads % kv_heads \
            or cfg.head_size % 2:
        raise ValueError(f"{path}: implausible header {HEADER.unpack_from(raw)}")
    need = sum(int(np.prod(s)) for _, s in cfg.shapes()) * 4
    if len(raw) - HEADER.size != need:
        raise ValueError(f"{path}: {len(raw) - HEADER.size} weight bytes, header {cfg} needs {need}")
    flat = np.frombuffer(raw, dtype="<f4", offset=HEADER.size)
    weights, at = {}, 0
    for name, shape in cfg.shapes():
        n = int(np.prod(shape))
        weights[name] = flat[at:at + n].reshape(shape)
        at += n
    return cfg, weights


def write_llama2c(path: str | Path, cfg: L2CConfig, weights: dict[str, np.ndarray]) -> None:
    """The inverse of read_llama2c (tests write small random checkpoints with it)."""
    vocab = cfg.vocab_size if cfg.shared_classifier else -cfg.vocab_size
    parts = [HEADER.pack(cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, vocab, cfg.seq_len)]
    for name, shape in cfg.shapes():
        w = np.asarray(weights[name], dtype="<f4")
        if w.shape != shape:
            raise ValueError(f"{name}: shape {w.shape}, expected {shape}")
        parts.append(w.tobytes())
    Path(path).write_bytes(b"".join(parts))


def rope_tables(seq_len: int, head_size: int, theta: float = ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
    """llama2.c export's freq_cis_real / freq_cis_imag, [seq_len, head_size/2]."""
    freqs = 1.0 / theta ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size)
    ang = np.outer(np.arange(seq_len, dtype=np.float64), freqs)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def reference_logits(cfg: L2CConfig, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """[T, vocab] float64 logits of run.c's forward over ids (positions 0..T-1), from the file's
    weights and RoPE tables as they are: interleaved pairs, GQA head h reading KV head h // group."""
    T, hs, H, KV = len(ids), cfg.head_size, cfg.n_heads, cfg.n_kv_heads
    f = {k: v.astype(np.float64) for k, v in w.items()}
    cos, sin = f["freq_cis_real"][:T, None, :], f["freq_cis_imag"][:T, None, :]

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + RMS_EPS) * g

    def rope(x: np.ndarray) -> np.ndarray:   # [T, heads, hs], pairs (2i, 2i+1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    x = f["token_embedding"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for layer in range(cfg.n_layers):
        xb = rms(x, f["rms_att"][layer])
        q = rope((xb @ f["wq"][layer].T).reshape(T, H, hs))
        k = rope((xb @ f["wk"][layer].T).reshape(T, KV, hs))
        v = (xb @ f["wv"][layer].T).reshape(T, KV, hs)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        att = np.einsum("thd,shd->hts", q, k) / np.sqrt(hs) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", att, v).reshape(T, cfg.dim) @ f["wo"][layer].T
        xb = rms(x, f["rms_ffn"][layer])
        h1 = xb @ f["w1"][layer].T
        x = x + (h1 / (1 + np.exp(-h1)) * (xb @ f["w3"][layer].T)) @ f["w2"][layer].T
    x = rms(x, f["rms_final"])
    return x @ (f["token_embedding"] if cfg.shared_classifier else f["wcls"]).T


# --------------------------------------------------------------------------- conversion
def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """transformers' convert_llama_weights_to_hf permute: interleaved RoPE pairs -> rotate-half."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def hf_state_dict(cfg: L2CConfig, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sd = {"model.embed_tokens.weight": w["token_embedding"], "model.norm.weight": w["rms_final"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = _permute(w["wq"][i], cfg.n_heads)
        sd[p + "self_attn.k_proj.weight"] = _permute(w["wk"][i], cfg.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = w["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = w["wo"][i]
        sd[p + "mlp.gate_proj.weight"] = w["w1"][i]
        sd[p + "mlp.down_proj.weight"] = w["w2"][i]
        sd[p + "mlp.up_proj.weight"] = w["w3"][i]
        sd[p + "input_layernorm.weight"] = w["rms_att"][i]
        sd[p + "post_attention_layernorm.weight"] = w["rms_ffn"][i]
    if not cfg.shared_classifier:
        sd["lm_head.weight"] = w["wcls"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}


def hf_config(cfg: L2CConfig) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
            "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_size,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_len, "rms_norm_eps": RMS_EPS,
            "rope_theta": ROPE_THETA, "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
            "hidden_act": "silu", "tie_word_embeddings": cfg.shared_classifier, "attention_bias": False,
            "mlp_bias": False, "torch_dtype": "float32", "bos_token_id": BOS, "eos_token_id": EOS}


def write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    """A WordLevel tokenizer over placeholder symbols <unk> <s> </s> t3 .. t{vocab-1}: prompts are ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="</s>", model_max_length=model_max_length,
                            clean_up_tokenization_spaces=False).save_pretrained(str(out))


def convert(bin_path: str | Path, out: str | Path) -> Path:
    """llama2.c .bin -> HF Llama checkpoint directory (float32 safetensors + config + tokenizer)."""
    from safetensors.numpy import save_file

    cfg, w = read_llama2c(bin_path)
    cos, sin = rope_tables(cfg.seq_len, cfg.head_size)
    if not (np.allclose(w["freq_cis_real"], cos, atol=1e-5) and np.allclose(w["freq_cis_imag"], sin, atol=1e-5)):
        raise ValueError(f"{bin_path}: its RoPE tables are not theta={ROPE_THETA}'s")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(cfg, w), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}))
    write_tokenizer(out, cfg.vocab_size, cfg.seq_len)
    return out


def transformers_logits(model_dir: str | Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


# --------------------------------------------------------------------------- checks
def check_conversion(bin_path: Path, model_dir: Path, seqs: list[list[int]], max_new: int) -> dict[str, Any]:
    """transformers vs the .bin's reference forward (max |Δ logit|); engine greedy vs transformers greedy."""
    import torch
    from transformers import LlamaForCausalLM
    from pdserve.engine import LLM, SamplingParams

    cfg, w = read_llama2c(bin_path)
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    deltas, hf_greedy = [], []
    with torch.no_grad():
        for ids in seqs:
            hf = model(torch.tensor([ids])).logits[0].double().numpy()
            deltas.append(float(np.abs(hf - reference_logits(cfg, w, ids)).max()))
            g = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new,
                               pad_token_id=EOS, eos_token_id=None)
            hf_greedy.append(g[0, len(ids):].tolist())
    with LLM(str(model_dir)) as llm:
        outs = llm.generate(seqs, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))
    engine_greedy = [o.token_ids for o in outs]
    return {"seq_lens": [len(s) for s in seqs], "max_abs_dlogit_hf_vs_reference": deltas,
            "engine_greedy_equals_hf": [a == b for a, b in zip(engine_greedy, hf_greedy)],
            "new_tokens": max_new}


def sample_prompts(model_dir: Path, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n prompts the model wrote itself: BOS, then lo-1..hi-1 tokens at temperature 1 (seeded)."""
    from pdserve.engine import LLM, SamplingParams

    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(n)]
    with LLM(str(model_dir)) as llm:
        outs = llm.generate([[BOS]] * n, [SamplingParams(temperature=1.0, seed=seed * 1000 + i, max_tokens=L - 1,
                                                         ignore_eos=True) for i, L in enumerate(lens)])
    return [[BOS] + o.token_ids for o in outs]


def codec_ratios(model_dir: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """Each codec's raw/wire bytes over the full KV blocks of the prompts, read from the engine's pool
    as the prefill worker does, and int8's max |error| relative to each vector's max."""
    import torch
    from pdserve.engine import LLM, SamplingParams
    from pdserve.services.kv_transfer import wire_codec as kc

    raw = {c: 0 for c in kc.CODECS}
    wire = dict(raw)
    rel_err = 0.0
    with LLM(str(model_dir)) as llm:
        bm = llm.engine.block_manager
        for ids in prompts:
            llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))
            kv = llm.engine.runner.read_blocks([bm.hash_to_block[h] for h in bm.computed_prefix_blocks(ids)])
            dtype, shape = str(kv.dtype).removeprefix("torch."), tuple(kv.shape[1:])
            for b in kv:
                b = b.contiguous()
                view = memoryview(b.reshape(-1).view(torch.uint8).numpy())
                for codec in kc.CODECS:
                    enc = kc.encode(view, dtype, shape, codec)
                    raw[codec] += view.nbytes
                    wire[codec] += enc.nbytes
                    if codec == "int8":
                        back = torch.frombuffer(kc.decode(enc.data, codec, dtype, shape, enc.raw_nbytes),
                                                dtype=kv.dtype).reshape(shape)
                        amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-30)
                        rel_err = max(rel_err, float(((back - b).abs() / amax).max()))
    return {"dtype": dtype, "block_shape": list(shape), "raw_bytes": raw["off"],
            "ratio": {c: raw[c] / wire[c] for c in kc.CODECS}, "int8_max_rel_error": rel_err}


# --------------------------------------------------------------------------- the deployment
def run_cluster(model_dir: Path, codec: str, prompts: list[list[int]], max_tokens: int, threads: int,
                log_dir: Path) -> list[dict[str, Any]]:
    """One `pdserve up` (1P + 1D, KV inline on the gRPC stream, --kv-compression codec); each prompt
    alone, greedy, logprobs=0. Returns per prompt: tokens, logprobs, the router's KV figures."""
    from pdserve.services.client import Client, build_request
    from pdserve.services.deployment.launcher import wait_serving
    from pdserve.services.common.ports import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--http-port", "none", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--prefill-workers", "1", "--decode-workers", "1", "--disaggregation", "always",
           "--threads", str(threads),
           "--kv-compression", codec, "--no-kv-shared-memory"]
    popen = drivers.start_up(cmd, log_dir / f"up-{codec}.log", f"[{codec}]")
    results = []
    try:
        wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            for i, ids in enumerate(prompts):
                req = build_request(ids, request_id=f"{codec}-{i}", max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=True)
                req.params.logprobs = 2   # the sampled token's logprob and the top two (their margin)
                toks: list[int] = []
                lps: list[float] = []
                margins: list[float] = []
                timings = None
                for msg in client.stub.Generate(req, timeout=120, metadata=client.metadata):
                    toks.extend(msg.token_ids)
                    lps.extend(lp.logprob for lp in msg.logprobs)
                    margins.extend(lp.top_logprobs[0] - lp.top_logprobs[1] for lp in msg.logprobs)
                    if msg.finished:
                        timings = msg.timings
                if timings is None or len(toks) != max_tokens or len(lps) != len(toks):
                    raise RuntimeError(f"[{codec}] prompt {i}: {len(toks)} tokens, {len(lps)} logprobs, "
                                       f"finished={timings is not None}")
                results.append({"tokens": toks, "logprobs": lps, "top2_margins": margins, "kv_codec": timings.kv_codec,
                                "kv_bytes": timings.kv_bytes, "kv_wire_bytes": timings.kv_wire_bytes,
                                "prefill_route": timings.prefill_route})
    finally:
        drivers.stop_up(popen)
    return results


def _roundtrip(x, variant: str):
    """One KV tensor [batch, kv_heads, tokens, head_dim] through the int8 wire codec, or rounded to a
    16-bit float (the baselines: what storing the cache in bf16 / fp16 would do)."""
    import torch
    from pdserve.services.kv_transfer import wire_codec as kc

    if variant in ("bfloat16", "float16"):
        return x.to(getattr(torch, variant)).to(x.dtype)
    shape = tuple(x.shape)
    enc = kc.encode(memoryview(x.contiguous().numpy()).cast("B"), "float32", shape, variant)
    return torch.frombuffer(bytearray(kc.decode(enc.data, variant, "float32", shape, enc.raw_nbytes)),
                            dtype=torch.float32).reshape(shape)


def hf_runs(model, prompts: list[list[int]], max_tokens: int, variant: str) -> list[dict[str, Any]]:
    """The hand-off replayed in transformers (offline cross-check): prefill the prompt, take the first
    token from its exact logits (the prefill worker samples before shipping), pass the prompt's KV
    through ``variant`` ("off" leaves it), then decode greedily from that cache."""
    import torch

    results = []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            cache = out.cache
            if variant != "off":
                for layer in cache.layers:
                    layer.keys, layer.values = _roundtrip(layer.keys, variant), _roundtrip(layer.values, variant)
            toks, lps, margins = [], [], []
            logits = out.logits[0, -1]
            for _ in range(max_tokens):
                lp = torch.log_softmax(logits.double(), -1)
                top = torch.topk(lp, 2).values
                tok = int(lp.argmax())
                toks.append(tok)
                lps.append(float(lp[tok]))
                margins.append(float(top[0] - top[1]))
                out = model(torch.tensor([[tok]]), cache=cache, use_cache=True)
                cache, logits = out.cache, out.logits[0, -1]
            results.append({"tokens": toks, "logprobs": lps, "top2_margins": margins, "kv_codec": variant,
                             "kv_bytes": 0, "kv_wire_bytes": 0, "prefill_route": "transformers"})
    return results


def replay_in_transformers(model_dir: Path, prompts: list[list[int]], args) -> dict[str, dict[str, Any]]:
    import torch
    from transformers import LlamaForCausalLM

    variants = [v for v in args.hf_variants.split(",") if v]
    if not variants:
        return {}
    torch.set_num_threads(1)   # one-token steps of a tiny model: more threads only contend
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    t0 = time.perf_counter()
    exact = hf_runs(model, prompts, args.max_tokens, "off")
    rows = {v: compare(exact, hf_runs(model, prompts, args.max_tokens, v)) for v in variants}
    print(f"transformers replay of {variants}: {time.perf_counter() - t0:.0f}s", flush=True)
    return rows


def compare(exact: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """Agreement of other's greedy outputs with exact's, and |Δ logprob| before the first divergence
    (the diverging position itself excluded: its tokens differ, so its logprobs are not comparable)."""
    firsts, deltas = [], []
    n = len(exact[0]["tokens"])
    for a, b in zip(exact, other):
        first = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), n)
        firsts.append(first)
        deltas.extend(abs(x - y) for x, y in zip(a["logprobs"][:first], b["logprobs"][:first]))
    diverged = [f for f in firsts if f < n]
    margins = [a["top2_margins"][f] for a, f in zip(exact, firsts) if f < n]
    all_margins = [m for a in exact for m in a["top2_margins"]]
    return {"prompts": len(firsts), "identical_share": sum(f == n for f in firsts) / len(firsts),
            "tokens_before_divergence_share": sum(firsts) / (n * len(firsts)),
            "mean_first_divergence_of_diverged": float(np.mean(diverged)) if diverged else None,
            "mean_abs_dlogprob": float(np.mean(deltas)) if deltas else 0.0,
            "max_abs_dlogprob": float(np.max(deltas)) if deltas else 0.0, "aligned_positions": len(deltas),
            "kv_codecs_seen": sorted({r["kv_codec"] for r in other}),
            "kv_bytes_over_wire_bytes": (sum(r["kv_bytes"] for r in other) / sum(r["kv_wire_bytes"] for r in other)
                                         if all(r["kv_wire_bytes"] for r in other) else None),
            "prefill_routes": sorted({r["prefill_route"] for r in other}), "first_divergence": firsts,
            "exact_top2_margin_at_divergence": margins,
            "exact_top2_margin_median_all_positions": float(np.median(all_margins)),
            "exact_top2_margin_below_0.05_share": float(np.mean([m < 0.05 for m in all_margins]))}


def table(rows: dict[str, dict[str, Any]], ratios: dict[str, Any]) -> str:
    lines = ["| codec vs off | identical outputs | tokens before 1st divergence | mean 1st divergence (diverged) "
             "| mean abs Δ logprob | max abs Δ logprob | wire ratio (router) | bytes ratio (offline) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for codec, r in rows.items():
        fd = r["mean_first_divergence_of_diverged"]
        wr = r["kv_bytes_over_wire_bytes"]
        br = ratios["ratio"].get(codec)
        lines.append(f"| {codec} | {r['identical_share']:.1%} | {r['tokens_before_divergence_share']:.1%} | "
                     f"{'-' if fd is None else f'{fd:.1f}'} | {r['mean_abs_dlogprob']:.2e} | "
                     f"{r['max_abs_dlogprob']:.2e} | {'-' if wr is None else f'{wr:.3f}'} | "
                     f"{'-' if br is None else f'{br:.3f}'} |")
    return "\n".join(lines)


def build_parser():
    p = drivers.parser(__doc__)
    p.add_argument("--bin", default=None, help="stories260K.bin (default: from --mirror at --mirror-commit)")
    p.add_argument("--mirror", default="/work/.mirror/plctlab+rvspoc-s2311-llama2/repo")
    p.add_argument("--mirror-commit", default="fca8a35")
    p.add_argument("--model-dir", default=None, help="where the HF checkpoint goes (default: a temp dir)")
    drivers.add_flags(p, num_prompts=32, min_len=64, max_len=400, max_tokens=64, seed=0, threads=1)
    p.add_argument("--codecs", default="off,lossless,int8", help="the first is the exact reference")
    p.add_argument("--hf-variants", default="int8,bfloat16,float16",
                   help="the hand-off replayed in transformers with the prompt's KV through each of these "
                        "(int8: the codec; bfloat16/float16: rounding baselines), against it unchanged; '' skips")
    p.add_argument("--out", default=None, help="write the JSON results here")
    return p


def _bin_path(args, tmp: Path) -> Path:
    if args.bin:
        return Path(args.bin)
    import subprocess
    path = tmp / "stories260K.bin"
    spec = f"{args.mirror_commit}:stories260K.bin"
    path.write_bytes(subprocess.run(["git", f"--git-dir={args.mirror}", "show", spec],
                                    check=True, capture_output=True).stdout)
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    codecs = [c for c in args.codecs.split(",") if c]
    t0 = time.perf_counter()
    log_dir = drivers.result_dir(None, "kv-int8-quality")
    with tempfile.TemporaryDirectory(prefix="kv-int8-") as tmp_name:
        tmp = Path(tmp_name)
        bin_path = _bin_path(args, tmp)
        cfg, _ = read_llama2c(bin_path)
        model_dir = convert(bin_path, Path(args.model_dir) if args.model_dir else tmp / "hf")
        print(f"{bin_path}: {cfg}; HF checkpoint in {model_dir}", flush=True)
        rng = random.Random(args.seed)
        seqs = [[BOS] + [rng.randrange(3, cfg.vocab_size) for _ in range(n - 1)] for n in (8, 64, 200)]
        checks = check_conversion(bin_path, model_dir, seqs, max_new=32)
        print(f"check: transformers vs llama2.c reference forward, max |Δ logit| per sequence "
              f"{checks['seq_lens']}: {['%.2e' % d for d in checks['max_abs_dlogit_hf_vs_reference']]}")
        print(f"check: pdserve engine greedy == transformers greedy ({checks['new_tokens']} tokens): "
              f"{checks['engine_greedy_equals_hf']}", flush=True)
        if max(checks["max_abs_dlogit_hf_vs_reference"]) > 1e-3 or not all(checks["engine_greedy_equals_hf"]):
            raise SystemExit("conversion checks failed")
        prompts = sample_prompts(model_dir, args.num_prompts, args.min_len, args.max_len, args.seed)
        print(f"{len(prompts)} prompts sampled from the model, {min(map(len, prompts))}-{max(map(len, prompts))} "
              f"tokens (mean {np.mean([len(p) for p in prompts]):.0f})", flush=True)
        ratios = codec_ratios(model_dir, prompts)
        print(f"offline bytes ratios on real KV ({ratios['dtype']}{ratios['block_shape']} blocks, "
              f"{ratios['raw_bytes'] / 1e6:.2f} MB): {ratios['ratio']}; int8 max error / vector max "
              f"{ratios['int8_max_rel_error']:.4f}", flush=True)
        runs = {c: run_cluster(model_dir, c, prompts, args.max_tokens, args.threads, log_dir) for c in codecs}
        hf_rows = replay_in_transformers(model_dir, prompts, args)
    rows = {c: compare(runs[codecs[0]], runs[c]) for c in codecs[1:]}
    text = table(rows, ratios)
    print("\n" + text + "\n")
    hf_text = table(hf_rows, ratios) if hf_rows else ""
    if hf_rows:
        print("the same hand-off replayed in transformers (KV perturbed between prefill and decode):\n"
              + hf_text.replace("codec vs off", "variant vs exact") + "\n")
    for codec, r in [*rows.items(), *((f"transformers {k}", v) for k, v in hf_rows.items())]:
        m = r["exact_top2_margin_at_divergence"]
        if m:
            print(f"{codec}: exact run's top-1 minus top-2 logprob where {codec} diverged: median {np.median(m):.3f}, "
                  f"max {max(m):.3f} (all positions: median {r['exact_top2_margin_median_all_positions']:.3f}, "
                  f"{r['exact_top2_margin_below_0.05_share']:.1%} under 0.05); first divergences "
                  f"{sorted(f for f in r['first_divergence'] if f < args.max_tokens)}")
    print(f"done in {time.perf_counter() - t0:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "model": asdict(cfg), "checks": checks,
                                              "offline_codec": ratios, "vs_" + codecs[0]: rows,
                                              "transformers_replay_vs_exact": hf_rows,
                                              "table_markdown": text, "transformers_table_markdown": hf_text,
                                              "prompt_lens": [len(p) for p in prompts]}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
