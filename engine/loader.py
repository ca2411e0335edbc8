"""Load Hugging Face safetensors weights into a pdserve model.

Each tensor is handed to its owner as a lazy slice of the file (safetensors' get_slice): a
tensor-parallel layer reads only its own rows or columns, so a rank never holds the whole of a
tensor it shards; other owners read it whole (engine.layers.linear.materialize).

A pre-quantized W8A16 checkpoint (config.json's quantization_config quant_method pdserve_w8a16,
as engine/checkpoints/gguf_checkpoint.py writes a Q8_0 file) holds some linears' weights in int8,
each with ``<linear>.weight_scale`` (one float scale per output row) beside it: those linears
take them as they are (Linear.hold_int8), never widened to a float weight."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from torch import nn

from pdserve.engine.layers.linear import W8A16_SCALE, Linear, ParallelLMHead, TensorSource, materialize

# config.json quantization_config.quant_method -> the engine's quantization its weights are stored in
PREQUANTIZED_METHODS = {"pdserve_w8a16": "w8a16"}


def checkpoint_quantization(model_dir: str | Path) -> str | None:
    """The quantization a checkpoint's weights are stored in, from its config.json: "w8a16" for
    pdserve's pre-quantized W8A16, None for float weights. ValueError for a method pdserve
    cannot load (its weights would not be what the engine expects)."""
    path = Path(model_dir) / "config.json"
    quant = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in PREQUANTIZED_METHODS:
        raise ValueError(f"checkpoint in {model_dir!s} is quantized with {str(method)[:40]!r}, which pdserve does "
                         f"not load; it loads float checkpoints and {', '.join(PREQUANTIZED_METHODS)}")
    return PREQUANTIZED_METHODS[method]


def hold_int8_linears(model: nn.Module, model_dir: str | Path) -> set[str]:
    """Set up each Linear whose checkpoint weight is int8 to take it as it is stored
    (Linear.hold_int8, which drops its float weight), reading only the files' headers: called
    before any weight is converted or read. Idempotent. Returns the model-side names those
    linears' weights and scales load under (packed q/k/v and gate/up under their packed name)."""
    dtypes: dict[str, str] = {}
    for file in _files(model_dir):
        dtypes.update(_header_dtypes(file))
    int8 = {n for n, d in dtypes.items() if d == "I8"}
    scaled = {n.removesuffix("_scale") for n in dtypes if n.endswith("." + W8A16_SCALE)}
    if not int8 and not scaled:
        return set()
    if checkpoint_quantization(model_dir) != "w8a16":
        raise ValueError(f"checkpoint in {model_dir!s} holds int8 weights but its config.json does not declare "
                         f"quantization_config quant_method {next(iter(PREQUANTIZED_METHODS))}")
    unpaired = sorted(int8 ^ scaled)
    if unpaired:
        raise ValueError(f"checkpoint in {model_dir!s}: int8 weights and their _scale tensors do not pair up: "
                         f"{', '.join(unpaired[:4])}")
    packed = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    held: set[str] = set()
    for name in sorted(int8):
        if tied and name == "lm_head.weight":
            continue
        target = _packed_name(packed, name) or name
        try:
            owner = model.get_submodule(target.rsplit(".", 1)[0]) if target.endswith(".weight") else None
        except AttributeError:
            owner = None
        if not isinstance(owner, Linear) or isinstance(owner, ParallelLMHead):
            raise ValueError(f"checkpoint tensor {name!r} is int8, but only linear layers' weights load as int8")
        owner.hold_int8()
        held |= {target, f"{target}_scale"}
    return held


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    files = _files(model_dir)
    held = hold_int8_linears(model, model_dir)
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name or (tied and name.startswith("lm_head.weight")):
                    continue
                loaded.add(_load_one(model, params, packed, held, name, f.get_slice(name)))
    expected = set(params) | held
    missing = {n for n in expected if n not in loaded and not (tied and n == "lm_head.weight")}
    if missing:
        raise ValueError(f"checkpoint in {model_dir!s} lacks weights: {', '.join(sorted(missing)[:8])}")


def _files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir!s} has no *.safetensors files")
    return files


def _header_dtypes(file: Path) -> dict[str, str]:
    """Each tensor's dtype ("BF16", "I8", ...), from the file's header alone (no tensor is read)."""
    with safe_open(str(file), framework="pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


def _packed_name(packed: dict, name: str) -> str | None:
    for fragment, (packed_fragment, _) in packed.items():
        if f".{fragment}." in name:
            return name.replace(fragment, packed_fragment)
    return None


def _load_one(model: nn.Module, params: dict[str, nn.Parameter], packed: dict, held: set[str], name: str,
              tensor: TensorSource) -> str:
    for fragment, (packed_fragment, shard_id) in packed.items():
        if f".{fragment}." in name:
            target = name.replace(fragment, packed_fragment)
            _linear_for(model, target).load(target.rsplit(".", 1)[1], tensor, shard_id)
            return target
    if name not in params and name not in held:
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    if callable(getattr(owner, "load", None)):   # Linear and the tensor-parallel layers take their slice
        owner.load(name.rsplit(".", 1)[1], tensor, None)
    else:
        param, tensor = params[name], materialize(tensor)
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
        param.data.copy_(tensor)
    return name


def _linear_for(model: nn.Module, param_name: str) -> Linear:
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    if not isinstance(module, Linear):
        raise ValueError(f"{param_name} does not belong to a packed linear layer")
    return module
