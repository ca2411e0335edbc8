"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3). Qwen3 differs only by RMS norms on q and k
per head, Qwen2 only by a bias on q/k/v (none on o_proj: ModelConfig.qkv_bias).

Everything but the GEMMs goes through ``self.backend`` (engine/layers/backend.py): torch ops by
default, the fused native CPU kernels where the model runner selects them. The residual stream
is carried beside the layer output, so each residual add fuses with the RMS norm after it."""
from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.layers.attention import Attention, AttentionMetadata
from pdserve.engine.layers.backend import TORCH, TorchBackend
from pdserve.engine.layers.linear import ColumnParallelLinear, Linear, ParallelLMHead, RowParallelLinear
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.layers.vocab_embedding import VocabParallelEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel import TPGroup, TPLayout, split_range


class SelfAttention(nn.Module):
    backend: TorchBackend = TORCH

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup | None = None) -> None:
        super().__init__()
        d = cfg.head_dim
        if tp is None or tp.size == 1:
            self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
            self.qkv_proj = Linear(cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d],
                                   bias=cfg.qkv_bias)
            self.o_proj = Linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.attention_bias)
        else:   # this rank's query heads and the KV heads they read (engine/parallel.py)
            layout = TPLayout(tp.rank, tp.size, cfg.num_heads, cfg.num_kv_heads)
            self.num_heads, self.num_kv_heads = layout.local_heads, layout.local_kv_heads
            (h0, h1), (k0, k1) = layout.head_range, layout.kv_head_range
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [(h0 * d, h1 * d), (k0 * d, k1 * d), (k0 * d, k1 * d)],
                                                 bias=cfg.qkv_bias)
            self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, (h0 * d, h1 * d), tp,
                                            bias=cfg.attention_bias)
        self.head_dim = d
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.backend.qkv_rope_store(self, self.qkv_proj(x), positions, meta)
        out = self.backend.attention(self.attn, q, k, v, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    backend: TorchBackend = TORCH

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        if tp is None or tp.size == 1:
            self.inter = cfg.intermediate_size
            self.gate_up_proj = Linear(cfg.hidden_size, [self.inter, self.inter], bias=cfg.mlp_bias)
            self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            start, end = split_range(cfg.intermediate_size, tp.rank, tp.size)
            self.inter = end - start
            self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [(start, end), (start, end)], bias=cfg.mlp_bias)
            self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, (start, end), tp,
                                               bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_mul(self.gate_up_proj(x), self.inter))


class DecoderLayer(nn.Module):
    backend: TorchBackend = TORCH

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, residual: the stream before it (None at layer 0).
        Returns this layer's output and the stream before it."""
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, self.backend.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = self.backend.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, positions, meta)
        norm = self.post_attention_layernorm
        h, residual = self.backend.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    backend: TorchBackend = TORCH

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None or tp.size == 1
                             else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_type, cfg.rope_scaling)
        self.layers = nn.ModuleList([DecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta)
        if residual is None:
            return self.backend.rms_norm(x, self.norm.weight, self.norm.eps)
        return self.backend.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (packed module fragment, shard index)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    backend: TorchBackend = TORCH

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp_size = 1 if tp is None else tp.size
        self.model = LlamaModel(cfg, tp)
        self.lm_head = (Linear(cfg.hidden_size, cfg.vocab_size) if self.tp_size == 1
                        else ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.num_decode and not meta.prefills:   # decode-only: the backend may run it as one call
            hidden = self.backend.decode_model(self, input_ids, positions, meta)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (under tensor parallelism every rank must call this: it gathers)."""
        if isinstance(self.lm_head, ParallelLMHead):
            return self.lm_head.gather_logits(hidden)
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def set_backend(self, backend: TorchBackend) -> None:
        """Every module that runs ops through a backend uses this one from now on."""
        for module in self.modules():
            if hasattr(type(module), "backend"):
                module.backend = backend
