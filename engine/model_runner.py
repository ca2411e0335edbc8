"""Runs the model on a scheduled batch: builds inputs and attention metadata, samples."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine import cpu_features, hugepages
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.layers.attention import AttentionMetadata, PrefillSegment
from engine.layers.backend import TorchBackend, select_backend
from engine.layers.linear import Linear
from engine.layers.sampler import Sampler
from engine.loader import load_weights
from engine.model_config import ModelConfig
from engine.models import MODEL_CLASSES
from engine.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        dtype_name = model_config.torch_dtype if config.dtype == "auto" else config.dtype
        self.dtype = TORCH_DTYPES.get(dtype_name, torch.float32)        # checkpoint / KV cache dtype
        self.compute_dtype = self._compute_dtype()
        self.block_size = config.block_size
        self.model = self._load_model()
        self.num_kv_blocks = self._num_kv_blocks()
        # One spare block past the pool: CUDA graph padding rows write there, never into real KV.
        shape = (model_config.num_layers, 2, self.num_kv_blocks + 1, self.block_size,
                 model_config.num_kv_heads, model_config.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = hugepages.zeros(shape, self.dtype)
            cpu_features.log_once("transparent huge pages: %s (KV pool and weights %s)", hugepages.thp_mode(),
                                  "on 2 MiB pages" if hugepages.enabled() else "on ordinary pages")
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.backend: TorchBackend = select_backend(self.device, self.kv_cache[0, 0], model_config.head_dim,
                                                    self.compute_dtype)
        self.set_backend(self.backend)
        cpu_features.log_once("engine backend: %s (compute %s, KV cache %s)", self.backend.name,
                              str(self.compute_dtype).removeprefix("torch."), str(self.dtype).removeprefix("torch."))
        self.sampler = Sampler(config.seed, native=self.backend.name == "native-cpu")
        self._gather_bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self, max_batch=config.max_num_seqs)

    # ---- setup ----------------------------------------------------------------
    def _load_model(self) -> torch.nn.Module:
        cls = MODEL_CLASSES[self.model_config.architecture]
        with torch.device(self.device):
            model = cls(self.model_config)
        load_weights(model, Path(self.config.model))
        if self.compute_dtype != self.dtype:   # a wider compute dtype sees the weights rounded to dtype
            for param in model.parameters():
                param.data = param.data.to(self.dtype)
        model.to(dtype=self.compute_dtype)     # buffers (rotary tables) go straight to compute_dtype
        if self.config.quantization == "w8a16":
            for module in model.modules():
                if isinstance(module, Linear) and module is not getattr(model, "lm_head", None):
                    module.quantize_w8a16()
        if self.device.type == "cpu":
            # float32 math on weights that hold bf16 values (a bf16 checkpoint, whatever dtype says):
            # the bf16-weight kernel for decode rows; Linear checks the values are exactly bf16.
            bf16_weights = self.compute_dtype == torch.float32 and self.model_config.torch_dtype == "bfloat16"
            amx = self.compute_dtype == torch.bfloat16 and cpu_features.detect().amx_bf16
            linears = [m for m in model.modules() if isinstance(m, Linear)]
            for module in linears:
                module.pack_for_cpu(bf16_weights=bf16_weights, amx=amx)
            # Decode GEMMs stream these packed weights every step: one huge-page arena for all.
            packed = [m for m in linears if m.packed_amx is not None]
            for module, moved in zip(packed, hugepages.consolidate([m.packed_amx for m in packed])):
                module.packed_amx = moved
        return model.eval()

    def _compute_dtype(self) -> torch.dtype:
        if self.config.compute_dtype != "auto":
            return TORCH_DTYPES[self.config.compute_dtype]
        choice = cpu_features.choose_compute_dtype(
            self.dtype, self.device.type, cpu_features.detect(),
            bf16_gemm_supported=cpu_features.bf16_gemm_supported(),
            bf16_speedup=cpu_features.measured_bf16_speedup)
        cpu_features.log_once("compute dtype %s (auto): %s", str(choice.dtype).removeprefix("torch."), choice.reason)
        return choice.dtype

    def set_backend(self, backend: TorchBackend) -> None:
        """Use this backend's ops (and its attention metadata, and sampler path) from the next step on."""
        self.backend = backend
        self.model.set_backend(backend)
        if hasattr(self, "sampler"):
            self.sampler.native = backend.name == "native-cpu"

    @property
    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_memory_bytes
        blocks = budget // self.kv_bytes_per_block
        if blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of {self.kv_bytes_per_block} bytes")
        return blocks

    # ---- KV block access for the transports -------------------------------------
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[n, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous, on CPU."""
        ids = torch.tensor(block_ids, device=self.device)
        return self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        self.kv_cache[:, :, block_id].copy_(data.to(self.device, self.dtype))

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache dtype as it travels on the wire ("bfloat16", "float32", ...)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def block_shape(self) -> tuple[int, ...]:
        mc = self.model_config
        return (mc.num_layers, 2, self.block_size, mc.num_kv_heads, mc.head_dim)

    # ---- one step -------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """Computes the scheduled tokens; returns the sampled token per sequence, or None
        where the sequence is still mid-prefill."""
        input_ids, positions, meta, sample_rows, sample_seqs = self.prepare(batch)
        if self.graphs is not None and batch.num_decode_seqs == len(batch.seqs) and self.graphs.can_run(len(batch.seqs)):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        results: list[int | None] = [None] * len(batch.seqs)
        if sample_rows:
            if len(sample_rows) == hidden.shape[0]:   # every row samples (decode steps): rows are in order
                logits = self.model.compute_logits(hidden)
            else:
                logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            seqs = [batch.seqs[i] for i in sample_seqs]
            tokens = self.sampler(logits, [s.params for s in seqs], [s.num_output_tokens for s in seqs])
            for i, tok in zip(sample_seqs, tokens):
                results[i] = tok
        return results

    def prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        seqs, counts, nd = batch.seqs, batch.num_new_tokens, batch.num_decode_seqs
        # Decode rows go shortest context first (any row order is valid: results map back through
        # sample_seqs), so that rows of similar length form contiguous groups for attention.
        order = sorted(range(nd), key=lambda i: seqs[i].num_computed_tokens) if nd > 1 else list(range(nd))
        order.extend(range(nd, len(seqs)))
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        for i in order:
            seq, n = seqs[i], counts[i]
            start = seq.num_computed_tokens
            table = seq.block_table
            if n == 1:
                ids.append(seq.token_ids[start])
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:start + n])
                pos.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(i)
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev))
        if nd:
            self._prepare_decodes([seqs[i] for i in order[:nd]], meta)
        self._prepare_prefills([seqs[i] for i in order[nd:]], [counts[i] for i in order[nd:]], nd, meta)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return input_ids, positions, meta, sample_rows, sample_seqs

    def _prepare_decodes(self, decode_seqs: list, meta: AttentionMetadata) -> None:
        meta.num_decode = len(decode_seqs)
        lens = [s.num_computed_tokens + 1 for s in decode_seqs]   # context after this step's token
        self.backend.prepare_decode(self, decode_seqs, lens, meta)

    def decode_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for the per-layer decode KV gather, reused across layers and steps (fresh large
        allocations on CPU cost page faults every time)."""
        bufs = self._gather_bufs
        if bufs is None or bufs[0].shape[0] < rows:
            mc = self.model_config
            rows = max(rows, int(1.25 * bufs[0].shape[0]) if bufs is not None else 0)
            width = self.block_size * mc.num_kv_heads * mc.head_dim
            self._gather_bufs = bufs = (torch.empty(rows, width, dtype=self.dtype, device=self.device),
                                        torch.empty(rows, width, dtype=self.dtype, device=self.device))
        return bufs

    def _prepare_prefills(self, prefill_seqs: list, counts: list[int], row: int, meta: AttentionMetadata) -> None:
        dev = self.device
        cu_q, cu_k, tables = [0], [0], []
        for seq, n in zip(prefill_seqs, counts):
            start = seq.num_computed_tokens
            ctx = start + n
            mask = None
            if start > 0:
                future = torch.arange(ctx, device=dev)[None, :] > torch.arange(start, ctx, device=dev)[:, None]
                mask = torch.zeros(future.shape, dtype=self.compute_dtype, device=dev).masked_fill_(future, float("-inf"))
            n_blocks = -(-ctx // self.block_size)
            table = torch.tensor(seq.block_table[:n_blocks], dtype=torch.int64, device=dev)
            meta.prefills.append(PrefillSegment(row, row + n, ctx, table, mask))
            row += n
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + ctx)
            tables.append(seq.block_table)
        if meta.prefills and dev.type == "cuda":
            width = max(len(t) for t in tables)
            meta.prefill_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                     dtype=torch.int32, device=dev)
            meta.cu_seqlens_q = torch.tensor(cu_q, dtype=torch.int32, device=dev)
            meta.cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device=dev)
            meta.max_seqlen_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
            meta.max_seqlen_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
