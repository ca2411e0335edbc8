"""The loader hands each tensor over as a lazy slice of the checkpoint: a tensor-parallel rank
reads only its own rows or columns of the tensors it shards (a rank of a large model never holds
a whole one), and every parameter ends up exactly its slice of the checkpoint."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pdserve.engine import loader
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import MODEL_CLASSES
from pdserve.engine.parallel import padded_split


class _Recording:
    """safe_open whose slices count the elements each read returns, by tensor name."""

    def __init__(self, read: dict[str, int]) -> None:
        self.read = read

    def __call__(self, path: str, framework: str):
        handle, read = safe_open(path, framework), self.read

        class Slice:
            def __init__(self, name: str) -> None:
                self.name, self.inner = name, handle.get_slice(name)

            def get_dtype(self) -> str:   # the header's: no read
                return self.inner.get_dtype()

            def __getitem__(self, index) -> torch.Tensor:
                out = self.inner[index]
                read[self.name] = read.get(self.name, 0) + out.numel()
                return out

        class Handle:
            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                return None

            def keys(self):
                return handle.keys()

            def get_slice(self, name: str) -> Slice:
                return Slice(name)

            def get_tensor(self, name: str) -> torch.Tensor:
                raise AssertionError(f"{name} read whole, not through a slice")
        return Handle()


def test_a_tensor_parallel_rank_reads_only_its_shards(tiny_qwen3: str, monkeypatch) -> None:
    cfg = ModelConfig.from_dir(tiny_qwen3)
    files = sorted(Path(tiny_qwen3).glob("*.safetensors"))
    with safe_open(str(files[0]), "pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}
    for rank in (0, 1):
        model = MODEL_CLASSES[cfg.architecture](cfg, SimpleNamespace(rank=rank, size=2))
        read: dict[str, int] = {}
        monkeypatch.setattr(loader, "safe_open", _Recording(read))
        loader.load_weights(model, tiny_qwen3)
        monkeypatch.undo()
        for name, tensor in full.items():
            if name.endswith(("o_proj.weight", "down_proj.weight", "q_proj.weight", "gate_proj.weight",
                              "up_proj.weight", "embed_tokens.weight")):
                assert read[name] * 2 == tensor.numel(), (name, read[name], tensor.numel())   # half: its shard
        layer = model.model.layers[0]
        w = full["model.layers.0.self_attn.o_proj.weight"]
        cols = w.shape[1] // 2
        assert torch.equal(layer.self_attn.o_proj.weight.data, w[:, rank * cols:(rank + 1) * cols])
        w = full["model.layers.0.mlp.gate_proj.weight"]
        rows = w.shape[0] // 2
        assert torch.equal(layer.mlp.gate_up_proj.weight.data[:rows], w[rank * rows:(rank + 1) * rows])
        start, end, _ = padded_split(cfg.vocab_size, rank, 2)
        assert torch.equal(model.model.embed_tokens.weight.data[:end - start],
                           full["model.embed_tokens.weight"][start:end])


def test_a_single_rank_reads_each_tensor_once_whole(tiny_qwen3: str, monkeypatch) -> None:
    cfg = ModelConfig.from_dir(tiny_qwen3)
    model = MODEL_CLASSES[cfg.architecture](cfg, None)
    read: dict[str, int] = {}
    monkeypatch.setattr(loader, "safe_open", _Recording(read))
    loader.load_weights(model, tiny_qwen3)
    monkeypatch.undo()
    with safe_open(str(sorted(Path(tiny_qwen3).glob("*.safetensors"))[0]), "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, shape in sizes.items():
        if tied and name == "lm_head.weight":
            continue
        assert read[name] == torch.Size(shape).numel(), name
    checkpoint = load_file(str(sorted(Path(tiny_qwen3).glob("*.safetensors"))[0]))
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight.data,
                       checkpoint["model.layers.0.self_attn.o_proj.weight"].float())
