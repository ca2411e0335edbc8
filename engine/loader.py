"""Load Hugging Face safetensors weights into a pdserve model.

Each tensor is handed to its owner as a lazy slice of the file (safetensors' get_slice): a
tensor-parallel layer reads only its own rows or columns, so a rank never holds the whole of a
tensor it shards; other owners read it whole (engine.layers.linear.materialize)."""
from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from torch import nn

from pdserve.engine.layers.linear import Linear, TensorSource, materialize


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir!s} has no *.safetensors files")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                    continue
                loaded.add(_load_one(model, params, packed, name, f.get_slice(name)))
    missing = {n for n in params if n not in loaded and not (tied and n == "lm_head.weight")}
    if missing:
        raise ValueError(f"checkpoint in {model_dir!s} lacks weights: {', '.join(sorted(missing)[:8])}")


def _load_one(model: nn.Module, params: dict[str, nn.Parameter], packed: dict, name: str, tensor: TensorSource
              ) -> str:
    for fragment, (packed_fragment, shard_id) in packed.items():
        if f".{fragment}." in name:
            target = name.replace(fragment, packed_fragment)
            _linear_for(model, target).load(target.rsplit(".", 1)[1], tensor, shard_id)
            return target
    if name not in params:
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
