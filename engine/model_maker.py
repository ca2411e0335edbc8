"""Deterministic maker of small random-weight Hugging Face checkpoints.

``make_model(out_dir, preset, arch, seed)`` writes a directory that
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load
directly: ``config.json``, ``generation_config.json``, ``model.safetensors`` and
a byte-level BPE tokenizer trained on the English corpus shipped in
``engine/data``, with a plain-text chat template (``CHAT_TEMPLATE``).  Same arguments always give byte-identical files.

Besides the test and benchmark sizes, two presets have real models' exact shapes and vocabulary
sizes (``qwen3-0.6b``, ``llama-3.2-1b``) with a small trained tokenizer: their model ids past the
tokenizer's are valid but never sampled (see ``weight_chunks``), so workloads are token ids.
Weights are drawn and written chunk by chunk (``engine.safetensors_stream``): memory stays
near one chunk, not twice the checkpoint.

The weights are random but scaled so that logits are well separated (greedy
decoding is stable between two float32 implementations) and greedy output is
varied.  Command line: ``python -m engine.model_maker OUT_DIR --preset small``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.engine.presets import (ARCHITECTURES,
    DEFAULT_ARCH,
    DEFAULT_PRESET,
    PRESETS,
    Arch,
    Preset,
    PresetName,
    get_preset,
    resolve_arch)
from pdserve.engine.cache_dir import build_once
from pdserve.engine.safetensors_stream import write_safetensors
from pdserve.engine.settings import pdserve_home

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN_ID = 0  # also the pad token
BOS_TOKEN_ID = 1
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN)  # trainer assigns ids in this order
SPECIAL_ROW_SCALE = 0.05  # see weight_chunks
CHUNK_ELEMENTS = 1 << 22  # elements drawn at a time (16 MiB of float32), see weight_chunks
RESIDUAL_GAIN = 2.0  # see weight_specs
QKV_BIAS_STD = 0.2  # qwen2's q/k/v biases, see weight_specs

# Bump when the output of make_model changes, so cached default models are rebuilt.
# 2: a chat template.
MAKER_VERSION = 2
DEFAULT_SEED = 0

DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_PATH = DATA_DIR / "corpus.txt"

# A plain-text chat template (the tokenizer has no chat special tokens): one "role: content"
# paragraph per message, then "assistant:" for the reply. Content may be a string or a list of
# OpenAI content parts ({"type": "text", "text": ...}).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] }}: "
    "{%- if message['content'] is string -%}{{ ' ' + message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ ' ' + part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '\\n\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant:' }}{%- endif -%}"
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}




# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    # Digits are split one per token (as Qwen does); ByteLevel maps every byte to a
    # symbol, so decode(encode(s)) == s for any string (no normalizer on purpose).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    paragraphs = CORPUS_PATH.read_text(encoding="utf-8").split("\n\n")
    tok.train_from_iterator(paragraphs, trainer=trainer)
    # If the corpus runs out of merges, pad with reserved specials so that every
    # model id decodes to something and len(tokenizer) == vocab_size.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tok.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID and tok.token_to_id(BOS_TOKEN) == BOS_TOKEN_ID
    return tok.to_str()


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained deterministically on the shipped corpus.

    Ids 0 and 1 are ``<|endoftext|>`` and ``<|bos|>``; vocab size is exactly
    ``vocab_size``. No BOS/EOS is added when encoding.
    """
    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


def _write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast  # lazy: transformers is slow to import

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    _write_json(out / "special_tokens_map.json", special)
    # Pin the class name so older transformers versions resolve it too.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.update(special, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False, add_eos_token=False)
    _write_json(cfg_path, cfg)


# --------------------------------------------------------------------------- config


def _write_configs(out: Path, p: Preset, arch: str) -> None:
    from transformers import GenerationConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        architectures=[ARCHITECTURES[arch]],
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim,
        hidden_act="silu",
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=p.rms_norm_eps,
        rope_parameters={"rope_type": p.rope_type, "rope_theta": p.rope_theta, **dict(p.rope_scaling)},
        tie_word_embeddings=p.tie_word_embeddings,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        dtype=p.dtype,
    )
    if arch != "qwen2":   # Qwen2's config has no such key: its q/k/v always have a bias, o_proj none
        common["attention_bias"] = False
    config = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[arch](**common)
    config.save_pretrained(str(out))
    # Also emit the legacy top-level keys that pre-v5 readers (and simple loaders) expect.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.update(torch_dtype=p.dtype, dtype=p.dtype, rope_theta=p.rope_theta)
    if p.rope_type != "default":
        cfg.update(rope_scaling={"rope_type": p.rope_type, **dict(p.rope_scaling)})
    _write_json(cfg_path, cfg)

    gen = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID, do_sample=False
    )
    gen.save_pretrained(str(out))


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- weights


def weight_specs(p: Preset, arch: str) -> Iterator[tuple[str, tuple[int, ...], float]]:
    """(HF tensor name, shape, init std) for every tensor; std 0 means ones (norms).

    Linears reading the residual stream use std 1/sqrt(fan_in) (unit-variance
    activations) and embeddings std 1, so logits have std ~sqrt(hidden) and are
    well separated.  The projections writing back into the residual stream
    (o_proj, down_proj) get an extra gain of RESIDUAL_GAIN * sqrt(hidden):
    otherwise the token's own embedding dominates the final hidden state and a
    tied lm_head keeps predicting the input token (pre-norm keeps this stable).
    Qwen2's q/k/v biases get std QKV_BIAS_STD: each changes most greedy tokens, yet the v
    bias (a constant every layer adds to the stream through o_proj) stays small enough that
    greedy output remains varied.
    """
    h, hd, inter = p.hidden_size, p.head_dim, p.intermediate_size
    q_out, kv_out = p.num_attention_heads * hd, p.num_key_value_heads * hd
    gain = RESIDUAL_GAIN * math.sqrt(h)
    yield "model.embed_tokens.weight", (p.vocab_size, h), 1.0
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", (h,), 0.0
        yield pre + "self_attn.q_proj.weight", (q_out, h), h**-0.5
        yield pre + "self_attn.k_proj.weight", (kv_out, h), h**-0.5
        yield pre + "self_attn.v_proj.weight", (kv_out, h), h**-0.5
        if arch == "qwen2":
            yield pre + "self_attn.q_proj.bias", (q_out,), QKV_BIAS_STD
            yield pre + "self_attn.k_proj.bias", (kv_out,), QKV_BIAS_STD
            yield pre + "self_attn.v_proj.bias", (kv_out,), QKV_BIAS_STD
        yield pre + "self_attn.o_proj.weight", (h, q_out), gain * q_out**-0.5
        if arch == "qwen3":
            yield pre + "self_attn.q_norm.weight", (hd,), 0.0
            yield pre + "self_attn.k_norm.weight", (hd,), 0.0
        yield pre + "post_attention_layernorm.weight", (h,), 0.0
        yield pre + "mlp.gate_proj.weight", (inter, h), h**-0.5
        yield pre + "mlp.up_proj.weight", (inter, h), h**-0.5
        yield pre + "mlp.down_proj.weight", (h, inter), gain * inter**-0.5
    yield "model.norm.weight", (h,), 0.0
    if not p.tie_word_embeddings:
        yield "lm_head.weight", (p.vocab_size, h), 1.0


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"pdserve:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw_rows(name: str, shape: tuple[int, ...], std: float, seed: int) -> Iterator[torch.Tensor]:
    """float32 N(0, std) rows, CHUNK_ELEMENTS at a time: the same values as one torch.randn of
    the whole shape, since torch draws normals 16 at a time (a chunk of a multiple of 16 elements
    leaves the generator where the whole draw would be; other row sizes are drawn whole)."""
    gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
    row = math.prod(shape[1:])
    step = shape[0] if row % 16 else max(1, CHUNK_ELEMENTS // row)
    for start in range(0, shape[0], step):
        yield torch.randn((min(step, shape[0] - start), *shape[1:]), generator=gen, dtype=torch.float32).mul_(std)


def weight_chunks(p: Preset, arch: str, seed: int, name: str, shape: tuple[int, ...], std: float
                  ) -> Iterator[torch.Tensor]:
    """One tensor's random weights as slices along its first dimension, in ``p.dtype``; each
    tensor has its own generator seeded from (seed, name).

    The output rows of the special tokens are shrunk (logit ~0 while the top logit is ~3
    sqrt(hidden)), so random models practically never emit EOS/BOS and generation length is set
    by max_tokens alone; so are the rows of ids past the tokenizer's (a real model's padding
    rows), so sampled tokens always have text and a text-timed client (TTFT at the first chunk
    with text) times every token.
    """
    dtype = _DTYPES[p.dtype]
    if std == 0.0:
        yield torch.ones(shape, dtype=dtype)
        return
    out_name = "model.embed_tokens.weight" if p.tie_word_embeddings else "lm_head.weight"
    start = 0
    for t in _draw_rows(name, shape, std, seed):
        if name == out_name:
            for lo, hi in ((0, len(SPECIAL_TOKENS)), (p.num_tokenizer_ids, p.vocab_size)):
                lo, hi = max(lo - start, 0), min(hi - start, t.shape[0])
                if lo < hi:
                    t[lo:hi] *= SPECIAL_ROW_SCALE
        start += t.shape[0]
        yield t.to(dtype)


def write_weights(path: Path, p: Preset, arch: str, seed: int) -> int:
    """Write ``model.safetensors`` chunk by chunk; returns its size in bytes."""
    stds = {name: (shape, std) for name, shape, std in weight_specs(p, arch)}
    return write_safetensors(path, [(name, shape) for name, (shape, _) in stds.items()], _DTYPES[p.dtype],
                             lambda name, shape: weight_chunks(p, arch, seed, name, shape, stds[name][1]),
                             metadata={"format": "pt"})


# --------------------------------------------------------------------------- public API


def make_model(
    out_dir: str | os.PathLike[str],
    preset: PresetName | str = DEFAULT_PRESET,
    arch: Arch | str | None = None,
    seed: int = DEFAULT_SEED,
) -> Path:
    """Write a complete HF checkpoint directory to ``out_dir`` and return its path (``arch``:
    None is the preset's own, else the default)."""
    arch = resolve_arch(preset, arch)
    p = get_preset(preset, arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_configs(out, p, arch)
    _write_tokenizer(out, p.num_tokenizer_ids, p.max_position_embeddings)
    weights_path = out / "model.safetensors"
    write_weights(weights_path, p, arch, seed)
    weights_path.chmod(0o644)  # safetensors creates it 0600; match the other files
    return out




def cached_model_dir(preset: str = DEFAULT_PRESET, arch: str | None = None, seed: int = DEFAULT_SEED) -> Path:
    """Cache location of a preset's deterministic checkpoint."""
    return pdserve_home() / "models" / f"{preset}-{resolve_arch(preset, arch)}-seed{seed}-v{MAKER_VERSION}"


def ensure_model(preset: str = DEFAULT_PRESET, arch: str | None = None, seed: int = DEFAULT_SEED) -> Path:
    """Make a preset's checkpoint in the cache on first use (atomically) and return its directory."""
    return build_once(cached_model_dir(preset, arch, seed), lambda out: make_model(out, preset, arch, seed))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a deterministic random-weight HF checkpoint.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default=None,
                        help=f"default: the preset's own, else {DEFAULT_ARCH}")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    print(make_model(args.out_dir, args.preset, args.arch, args.seed))


if __name__ == "__main__":
    main()
