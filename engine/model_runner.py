"""Runs the model on a scheduled batch: builds inputs and attention metadata, samples."""
from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Collection, NamedTuple

import torch

from pdserve.engine import cpu_features, heap, hugepages
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.layers.attention import AttentionMetadata, PrefillSegment
from pdserve.engine.layers.backend import TorchBackend, select_backend
from pdserve.engine.layers.linear import Linear
from pdserve.engine.layers.sampler import Sampler
from pdserve.engine.logits_context import logits_context
from pdserve.engine.logprobs import PromptScorer, TokenLogprob
from pdserve.engine.loader import checkpoint_quantization, hold_int8_linears, load_weights
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import MODEL_CLASSES
from pdserve.engine.parallel import RankProcesses, TPGroup, TPLayout, check_divisible
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.step_plan import OP_READ_KV, OP_WRITE_KV, StepPlan

log = logging.getLogger(__name__)

LOGIT_ROWS = 512   # vocabulary-wide logit rows computed at once (scored prompts can have thousands)
TRIM_EVERY_BYTES = 64 << 20   # while packing, freed weights go back to the system every this many bytes
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StepResult(NamedTuple):
    """What a step computed: per sequence of the batch its token(s) or None (ModelRunner.run), and
    the prompt logprobs scored this step, by batch index."""

    tokens: list
    prompt_logprobs: dict[int, list[TokenLogprob]]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    """Runs the model on this process's rank. With tensor_parallel_size > 1 the driver's runner
    (group None) starts the other ranks (engine/tp_rank.py) and sends them each step's plan; a
    rank's runner is built with its group and only executes plans."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, group: TPGroup | None = None) -> None:
        self.config = config
        self.model_config = model_config
        tp_size = config.tensor_parallel_size
        check_divisible(model_config.num_heads, model_config.num_kv_heads, tp_size)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        elif tp_size > 1:   # one thread per rank unless told otherwise: N ranks on N cores
            torch.set_num_threads(1)
        self.device = resolve_device(config.device) if group is None else group.device
        if tp_size > 1 and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        dtype_name = model_config.torch_dtype if config.dtype == "auto" else config.dtype
        self.dtype = TORCH_DTYPES.get(dtype_name, torch.float32)        # checkpoint / KV cache dtype
        # The weights' quantization: the engine's setting, else the one the checkpoint is stored in (a
        # pre-quantized W8A16 checkpoint runs as w8a16: its int8 linears as stored, the others as they are).
        self.quantization = config.quantization or checkpoint_quantization(config.model)
        self.compute_dtype = self._compute_dtype()
        self.ranks = None   # RankProcesses on a tensor-parallel driver
        if group is None and tp_size > 1:   # the ranks compute in the dtype chosen here
            compute = str(self.compute_dtype).removeprefix("torch.")
            self.ranks = RankProcesses(dataclasses.replace(config, compute_dtype=compute), self.device)
            group = self.ranks.group
        self.tp = group
        self.layout = TPLayout(group.rank if group else 0, tp_size, model_config.num_heads, model_config.num_kv_heads)
        self._pending_kv: list[tuple[list[int], torch.Tensor]] = []   # writes for the other ranks
        self._pending_lock = threading.Lock()
        self._kv_bytes: memoryview | None = None   # the CPU pool's bytes, for block_slabs
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        config, model_config = self.config, self.model_config
        self.block_size = config.block_size
        self.model = self._load_model()
        self.num_kv_blocks = self._num_kv_blocks()
        # One spare block past the pool: CUDA graph padding rows write there, never into real KV.
        shape = (model_config.num_layers, 2, self.num_kv_blocks + 1, self.block_size,
                 self.layout.local_kv_heads, model_config.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = hugepages.zeros(shape, self.dtype)
            cpu_features.log_once("transparent huge pages: %s (KV pool and weights %s)", hugepages.thp_mode(),
                                  "on 2 MiB pages" if hugepages.enabled() else "on ordinary pages")
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.backend: TorchBackend = select_backend(self.device, self.kv_cache[0, 0], model_config.head_dim,
                                                    self.compute_dtype, batch_invariant=self.batch_invariant)
        self.set_backend(self.backend)
        if self.config.batch_invariant and not (self.batch_invariant and self.backend.name == "native-cpu"):
            self.batch_invariant = False
            cpu_features.log_once("batch-invariant mode requested but not in force: it needs the native CPU "
                                  "kernels (backend %s, device %s)", self.backend.name, self.device.type)
        cpu_features.log_once("engine backend: %s (compute %s, KV cache %s, batch-invariant %s)", self.backend.name,
                              str(self.compute_dtype).removeprefix("torch."), str(self.dtype).removeprefix("torch."),
                              "on" if self.batch_invariant else "off")
        self.sampler = Sampler(config.seed, native=self.backend.name == "native-cpu")
        self._gather_bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.graphs: DecodeGraphs | None = None
        # CUDA graphs would capture the NCCL collectives of one rank only: eager under tensor parallelism.
        if self.device.type == "cuda" and not config.enforce_eager and self.layout.size == 1:
            self.graphs = DecodeGraphs(self, max_batch=config.max_num_seqs)

    def close(self) -> None:
        """Stop the other ranks (driver); idempotent."""
        if self.ranks is not None:
            self.ranks.stop()

    def check_ranks(self) -> None:
        """Raise RankFailure if a rank process of this driver has exited (a cheap poll, no collective)."""
        if self.ranks is not None:
            self.ranks.check_alive()

    # ---- setup ----------------------------------------------------------------
    def _load_model(self) -> torch.nn.Module:
        self.batch_invariant = False   # in force only where every linear and the backend support it
        cls = MODEL_CLASSES[self.model_config.architecture]
        with torch.device(self.device):
            model = cls(self.model_config, self.tp)
        # The linears a pre-quantized checkpoint holds in int8 take those as stored, their float
        # weights dropped before any is converted below.
        hold_int8_linears(model, Path(self.config.model))
        # The parameters take the checkpoint's dtype before any weight is read: loading into float32
        # ones first would hold twice a bf16 model. Their fresh (untouched) float32 pages cost nothing
        # to convert; every weight is then rounded to dtype as it is copied in, as a wider compute
        # dtype must see it.
        for param in model.parameters():
            if param.dtype != self.dtype:
                param.data = param.data.to(self.dtype)
        load_weights(model, Path(self.config.model))
        model.to(dtype=self.compute_dtype)     # buffers (rotary tables, int8 scales) go straight to compute_dtype
        if self.config.quantization == "w8a16":   # (those already int8 stay as the checkpoint has them)
            for module in model.modules():
                if (isinstance(module, Linear) and module.qweight is None
                        and module is not getattr(model, "lm_head", None)):
                    module.quantize_w8a16()
        if self.device.type == "cpu":
            # float32 math on weights that hold bf16 values (a bf16 checkpoint, whatever dtype says):
            # the bf16-weight kernel for decode rows; Linear checks the values are exactly bf16.
            bf16_weights = self.compute_dtype == torch.float32 and self.model_config.torch_dtype == "bfloat16"
            amx = self.compute_dtype == torch.bfloat16 and cpu_features.detect().amx_bf16
            linears = [m for m in model.modules() if isinstance(m, Linear)]
            # Batch-invariant mode needs one GEMM for every row count (or the mode is off); tuned mode
            # runs that GEMM too where it is this CPU's fastest.
            quantized = self.quantization is not None
            tuned_invariant = not self.config.batch_invariant and cpu_features.invariant_kernels_are_fastest(
                cpu_features.detect(), self.compute_dtype, quantized)
            packed = ((self.config.batch_invariant or tuned_invariant)
                      and self._pack_invariant(linears, amx, bf16dot_only=tuned_invariant))
            self.batch_invariant = packed and self.config.batch_invariant
            if packed and tuned_invariant:
                cpu_features.log_once("batch invariance off, but its kernels are this CPU's fastest for bf16 "
                                      "(AVX512-BF16 without AMX): tuned mode runs them")
            if not packed:
                for module in linears:
                    module.pack_for_cpu(bf16_weights=bf16_weights, amx=amx)
            # Decode GEMMs stream these packed weights every step: onto huge pages (TLB misses cost a
            # batch-1 decode step of the small model a third of its time on a Zen 4 VM).
            hugepages.move_onto_huge_pages(linears, "packed_amx")
            hugepages.move_onto_huge_pages(linears, "packed_invariant")
        heap.release_free_heap()   # what loading and packing freed, back to the system
        return model.eval()

    @staticmethod
    def _pack_invariant(linears: list[Linear], amx: bool, bf16dot_only: bool) -> bool:
        """Every linear onto the invariant GEMM (amx: the AMX kernel where it packs; bf16dot_only:
        linear_bf16dot, nothing else), each plain weight dropped as soon as its packed copy serves
        (so a model's two copies never coexist while it loads); should one not pack, all are
        unpacked, every plain weight back, and this returns False."""
        released = 0
        packed = True
        for module in linears:
            if not module.pack_invariant(amx) or (bf16dot_only and module.invariant_kernel != "bf16dot"):
                packed = False
                break
            released += module.release_plain_weight()   # at once where it can be unpacked again,
            if released >= TRIM_EVERY_BYTES:            # and its pages with it (engine/heap.py)
                heap.release_free_heap()
                released = 0
        for module in linears:
            if packed:   # every forward reads the packed copy: the plain weight goes
                module.weight = None   # (a tied embedding keeps its own reference)
            else:
                module.unpack_invariant()
        return packed

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
        """Bytes of one whole block (every KV head): what the hand-off carries per block."""
        mc = self.model_config
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize

    @property
    def local_kv_bytes_per_block(self) -> int:
        """Bytes of one block in this rank's pool (its KV heads)."""
        return self.kv_bytes_per_block // self.model_config.num_kv_heads * self.layout.local_kv_heads

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_memory_bytes
        blocks = budget // self.local_kv_bytes_per_block
        if blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of {self.local_kv_bytes_per_block} bytes")
        if self.tp is not None:   # every rank's pool has the same blocks: the smallest budget decides
            n = torch.tensor([blocks], dtype=torch.int64, device=self.tp.device)
            blocks = int(self.tp.all_reduce(n, torch.distributed.ReduceOp.MIN).item())
        return blocks

    # ---- KV block access for the transports -------------------------------------
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[n, num_layers, 2, block_size, num_kv_heads, head_dim] (every KV head), contiguous, on CPU."""
        pieces = self.read_block_pieces(block_ids)
        if len(pieces) == 1:
            return pieces[0][2]
        return torch.cat([data for _, _, data in pieces], dim=4)

    def read_block_pieces(self, block_ids: list[int]) -> list[tuple[int, int, torch.Tensor]]:
        """The blocks' KV heads as the ranks hold them: (head_start, head_end, [n, L, 2, bs, heads, D])
        per distinct rank slice, in head order, on CPU. One piece without tensor parallelism."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self.ranks is None:
            return [(0, self.model_config.num_kv_heads, self._local_blocks(ids).cpu())]
        with self.ranks.lock:
            self._flush_kv_writes()
            self.ranks.send([OP_READ_KV, len(block_ids)], ids)
            parts = self.gather_blocks(ids)
        pieces: list[tuple[int, int, torch.Tensor]] = []
        for (start, end), data in zip(self.layout.kv_head_ranges(), parts):
            if not pieces or pieces[-1][:2] != (start, end):   # replicated heads travel once
                pieces.append((start, end, data.cpu()))
        return pieces

    def block_views(self, block_ids: list[int]) -> list[torch.Tensor] | None:
        """Each block's KV as a view of the pool ([L, 2, bs, heads, D], every head, not contiguous):
        what a sender copies from as it frames them, while the blocks stay pinned. None where the
        pool is not this process's whole KV in host memory (another device, tensor parallelism)."""
        if self.ranks is not None or self.device.type != "cpu" or self.kv_cache.shape[2] < 2:
            return None   # (a one-block pool's view would be contiguous: a sender would not copy it)
        return [self.kv_cache[:, :, b] for b in block_ids]

    def block_slabs(self, block_ids: list[int]) -> list[memoryview] | None:
        """Each block's bytes as writable views of the pool, in the wire's order: for each block, its
        [bs, heads, D] slab of each layer's K then V (each contiguous in the pool). What a receiver
        reads a socket straight into. None where the pool is not this process's whole KV in host
        memory (another device, tensor parallelism)."""
        if self.ranks is not None or self.device.type != "cpu":
            return None
        if self._kv_bytes is None:
            self._kv_bytes = memoryview(self.kv_cache.view(torch.uint8).reshape(-1).numpy())
        layers, _, n_blocks = self.kv_cache.shape[:3]
        slab = self.kv_cache[0, 0, 0].numel() * self.kv_cache.element_size()
        flat, per_half = self._kv_bytes, n_blocks * slab
        return [flat[at:at + slab] for b in block_ids for half in range(2 * layers)
                for at in (half * per_half + b * slab,)]

    def _local_blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's heads of the blocks, [n, L, 2, bs, heads, D], contiguous."""
        if self.device.type != "cpu":
            return self.kv_cache.index_select(2, ids.to(self.device)).permute(2, 0, 1, 3, 4, 5).contiguous()
        # one copy per run of consecutive blocks, straight into the output: 2x faster than
        # index_select + permute + contiguous (two copies) for 75 blocks of 1.75 MiB, one thread
        block_ids = ids.tolist()
        cache = self.kv_cache
        out = torch.empty((len(block_ids), cache.shape[0], cache.shape[1], *cache.shape[3:]), dtype=cache.dtype)
        j = 0
        while j < len(block_ids):
            k = j + 1
            while k < len(block_ids) and block_ids[k] == block_ids[k - 1] + 1:
                k += 1
            out[j:k].copy_(cache[:, :, block_ids[j]:block_ids[j] + k - j].permute(2, 0, 1, 3, 4, 5))
            j = k
        return out

    def gather_blocks(self, ids: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank: its slice of the blocks, all-gathered (the driver gets them, in rank order)."""
        return self.tp.gather_to_driver(self._local_blocks(ids))

    def write_block(self, block_id: int, data: torch.Tensor, head_start: int = 0) -> None:
        """Write KV heads [head_start, head_start + data.shape[3]) of one block ([L, 2, bs, heads, D]).
        Each rank keeps the heads it holds; the other ranks' share is queued and written before the
        next step or read (they only ever receive from this process, which sends in order)."""
        entry = [block_id, head_start, head_start + data.shape[3]]
        data = data.to(self.dtype)
        self.apply_kv_writes(entry, data.reshape(-1))
        others = self.layout.kv_head_ranges()[1:]
        if self.ranks is not None and any(max(entry[1], a) < min(entry[2], b) for a, b in others):
            with self._pending_lock:
                self._pending_kv.append((entry, data.reshape(-1).clone()))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor, head_start: int = 0) -> None:
        """write_block for several blocks at once: data [n, L, 2, bs, heads, D] (one copy per run
        of blocks, not per block)."""
        n_heads = data.shape[4]
        entries = [x for b in block_ids for x in (b, head_start, head_start + n_heads)]
        data = data.to(self.dtype).reshape(-1)
        self.apply_kv_writes(entries, data)
        others = self.layout.kv_head_ranges()[1:]
        if self.ranks is not None and any(max(head_start, a) < min(head_start + n_heads, b) for a, b in others):
            with self._pending_lock:
                self._pending_kv.append((entries, data.clone()))

    def apply_kv_writes(self, entries: list[int], data: torch.Tensor) -> None:
        """Write the part of each (block, head range) entry this rank holds. data: the entries' KV
        back to back, each [L, 2, bs, heads, D]."""
        mc = self.model_config
        k0, k1 = self.layout.kv_head_range
        n_blocks = len(entries) // 3
        h0, h1 = (entries[1], entries[2]) if entries else (0, 0)
        if n_blocks > 1 and all(entries[i + 1:i + 3] == [h0, h1] for i in range(0, len(entries), 3)):
            lo, hi = max(h0, k0), min(h1, k1)   # blocks of the same heads: one copy for all of them
            if lo < hi:
                src = data[:n_blocks * mc.num_layers * 2 * self.block_size * (h1 - h0) * mc.head_dim].view(
                    n_blocks, mc.num_layers, 2, self.block_size, h1 - h0, mc.head_dim)
                src = src[:, :, :, :, lo - h0:hi - h0].permute(1, 2, 0, 3, 4, 5)
                dst = self.kv_cache[:, :, :, :, lo - k0:hi - k0]
                ids = entries[0::3]
                # each run of consecutive blocks a plain slice copy: measured 4.4x faster than one
                # index_copy_ over scattered blocks (8 blocks of 128 KiB, bf16, one CPU thread)
                j = 0
                while j < n_blocks:
                    k = j + 1
                    while k < n_blocks and ids[k] == ids[k - 1] + 1:
                        k += 1
                    dst[:, :, ids[j]:ids[j] + k - j].copy_(src[:, :, j:k])
                    j = k
            return
        at = 0
        for i in range(0, len(entries), 3):
            block_id, h0, h1 = entries[i:i + 3]
            n = mc.num_layers * 2 * self.block_size * (h1 - h0) * mc.head_dim
            chunk = data[at:at + n].view(mc.num_layers, 2, self.block_size, h1 - h0, mc.head_dim)
            at += n
            lo, hi = max(h0, k0), min(h1, k1)
            if lo < hi:
                self.kv_cache[:, :, block_id, :, lo - k0:hi - k0].copy_(chunk[:, :, :, lo - h0:hi - h0])

    def _flush_kv_writes(self) -> None:
        """Driver, under ranks.lock: send the queued KV writes to the other ranks."""
        with self._pending_lock:
            pending, self._pending_kv = self._pending_kv, []
        if not pending:
            return
        entries = [x for entry, _ in pending for x in entry]
        data = torch.cat([d for _, d in pending])
        self.ranks.send([OP_WRITE_KV, len(entries) // 3, data.numel()], torch.tensor(entries, dtype=torch.int64), data)

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache dtype as it travels on the wire ("bfloat16", "float32", ...)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One whole block (every KV head), as read_blocks returns and the hand-off carries."""
        mc = self.model_config
        return (mc.num_layers, 2, self.block_size, mc.num_kv_heads, mc.head_dim)

    # ---- one step -------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, stop_token_ids: Collection[int] = ()) -> StepResult:
        """Computes the scheduled tokens; returns the sampled token per sequence, None where the
        sequence is still mid-prefill, and for a decode verifying a draft the token sampled after
        each of its 1 + len(draft) rows (what its last token, then each draft token, is followed by);
        and the prompt logprobs scored for the sequences that asked (SamplingParams.prompt_logprobs).
        stop_token_ids: the model's EOS ids (min_tokens keeps them out)."""
        plan = StepPlan.from_batch(batch, self.block_size)
        scorer = PromptScorer(batch.seqs, plan) if plan.scored else None
        if self.ranks is None:
            logits = self.execute(plan, scorer)
        else:
            with self.ranks.lock:
                self._flush_kv_writes()
                self.ranks.send(*plan.encode())
                logits = self.execute(plan, scorer)
        results: list = [[] if batch.draft(i) else None for i in range(len(batch.seqs))]
        if logits is not None and plan.sample_seqs:
            seqs = [batch.seqs[i] for i in plan.sample_seqs]
            # a draft's rows sample the sequence's next output indexes, one each (seeded sampling keys on it)
            index, offsets, rows_before = [], [], {}
            for i, seq in zip(plan.sample_seqs, seqs):
                j = rows_before[i] = rows_before.get(i, -1) + 1
                offsets.append(j)
                index.append(seq.num_output_tokens + j)
            context = logits_context(seqs, offsets, [batch.draft(i) for i in plan.sample_seqs], stop_token_ids,
                                     self.model_config.vocab_size)
            tokens = self.sampler(logits, [s.params for s in seqs], index, context)
            for i, tok in zip(plan.sample_seqs, tokens):
                if results[i] is None:
                    results[i] = tok
                else:
                    results[i].append(tok)
        return StepResult(results, scorer.scores if scorer is not None else {})

    @torch.inference_mode()
    def execute(self, plan: StepPlan, scorer: PromptScorer | None = None) -> torch.Tensor | None:
        """This rank's forward pass over the plan; the sampled rows' full-vocabulary logits (None
        when no row samples), the scored prompt rows' handed to scorer. Under tensor parallelism
        every rank runs it, with the same plan."""
        input_ids, positions, meta = self.prepare(plan)
        if self.graphs is not None and plan.num_decode == len(plan.seqs) and self.graphs.can_run(len(plan.seqs)):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        rows = plan.sample_rows
        if not rows:
            return None
        # every row samples (decode steps): in order. (A rank's plan has no scored list: its rows may
        # be out of order, which only the driver, which keeps the logits, must mind.)
        if len(rows) == hidden.shape[0] and not plan.scored and len(rows) <= LOGIT_ROWS:
            return self.model.compute_logits(hidden)
        index = torch.tensor(rows, device=self.device)
        keep = scorer.num_sampled if scorer is not None else len(rows)
        kept = []
        # at most LOGIT_ROWS vocabulary-wide rows at a time (a long scored prompt); the slicing
        # depends on the row count alone, so that every rank gathers the same slices
        for at in range(0, len(rows), LOGIT_ROWS):
            logits = self.model.compute_logits(hidden[index[at:at + LOGIT_ROWS]])
            if at < keep:
                kept.append(logits[:keep - at])
            if scorer is not None and at + len(logits) > keep:
                scorer.add(logits[max(0, keep - at):])
        if not kept:
            return None
        return kept[0] if len(kept) == 1 else torch.cat(kept)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev, nd = self.device, plan.num_decode
        meta = AttentionMetadata(slot_mapping=torch.tensor(plan.slots, dtype=torch.int64, device=dev))
        if nd:
            self._prepare_decodes(plan.seqs[:nd], meta)
        self._prepare_prefills(plan.seqs[nd:], plan.num_new_tokens[nd:], nd, meta)
        input_ids = torch.tensor(plan.input_ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(plan.positions, dtype=torch.int64, device=dev)
        return input_ids, positions, meta

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
            width = self.block_size * self.layout.local_kv_heads * mc.head_dim
            self._gather_bufs = bufs = (torch.empty(rows, width, dtype=self.dtype, device=self.device),
                                        torch.empty(rows, width, dtype=self.dtype, device=self.device))
        return bufs

    def _prepare_prefills(self, prefill_seqs: list, counts: list[int], row: int, meta: AttentionMetadata) -> None:
        dev = self.device
        cu_q, cu_k, tables = [0], [0], []
        for seq, n in zip(prefill_seqs, counts):
            start = seq.num_computed_tokens
            ctx = start + n
            n_blocks = -(-ctx // self.block_size)
            table = torch.tensor(seq.block_table[:n_blocks], dtype=torch.int64, device=dev)
            meta.prefills.append(PrefillSegment(row, row + n, ctx, table, mask_dtype=self.compute_dtype))
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
