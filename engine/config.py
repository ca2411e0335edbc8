"""Engine configuration: one frozen-ish dataclass, validated on construction. Only ``role`` changes
afterwards, when an idle engine switches roles (LLMEngine.set_role); the policy follows it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.settings import setting
from pdserve.engine.spec_decode.config import SpeculativeConfig

ROLES = ("both", "prefill", "decode")
SCHEDULE_POLICIES = ("prefill_first", "interleave", "mixed")
PROMPT_ORDERS = ("fcfs", "shortest")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "w8a16")
# max_num_batched_tokens left to the engine (None): STEP_TOKENS, or CPU_PREFILL_STEP_TOKENS on a CPU
# prefill worker (steps of ~130-250 ms for the small model on a 2-core EPYC; docs/benchmarks.md, the trace)
STEP_TOKENS = 2048
CPU_PREFILL_STEP_TOKENS = 512
TP_TIMEOUT_RANGE_S = (0.5, 3600.0)   # tp_collective_timeout_s: above the slowest step, below "hung"




@dataclass(slots=True)
class EngineConfig:
    model: str = field(metadata={"help": "Hugging Face checkpoint directory (Qwen3 or Llama families)"})
    dtype: str = setting("auto", "weights and KV cache dtype; auto: the checkpoint's torch_dtype", choices=DTYPES)
    compute_dtype: str = setting("auto", "activations and matmuls; auto: on CPU chosen from the CPU for bf16 "
                                    "checkpoints (bf16 with AMX or fast bf16 GEMMs, else float32), "
                                    "elsewhere the checkpoint's dtype", choices=DTYPES)
    device: str = setting("auto", "cpu, cuda, cuda:N; auto: cuda when available")
    max_num_batched_tokens: int | None = setting(
        None, "token budget of one step (chunked prefill); none: 512 on a CPU prefill worker (a prompt token costs "
              "about the same there batched or not, so smaller steps let a burst's short prompts finish first), "
              "2048 otherwise")
    max_num_seqs: int = setting(64, "sequences in one step")
    max_model_len: int | None = setting(None, "longest sequence; default: the model's max_position_embeddings")
    block_size: int = setting(16, "tokens per KV block")
    num_kv_blocks: int | None = setting(None, "KV pool size in blocks; overrides the memory budget")
    kv_cache_memory_bytes: int = setting(1 << 30, "CPU: KV pool budget in bytes")
    gpu_memory_utilization: float = setting(0.85, "CUDA: fraction of free memory for the KV pool")
    enable_prefix_caching: bool = setting(True, "share computed blocks between prompts with a common prefix")
    kv_host_cache_bytes: int = setting(0, "KV tier in host RAM under the prefix cache: bytes of prefix blocks the "
                                          "pool evicts kept for reuse instead of recomputation (0: off)")
    kv_disk_cache_dir: str = setting("", "KV tier on disk under the prefix cache: a directory for prefix blocks "
                                         "evicted from the pool (or from the host tier), one file each; kept across "
                                         "restarts and shared by workers of the same model and user on one host; "
                                         "created 0700, and an existing one must be ours and 0700 (empty: off)")
    kv_disk_cache_bytes: int = setting(1 << 30, "bytes of block files one worker keeps in kv_disk_cache_dir (least "
                                                "recently used deleted first)")
    schedule_policy: str = setting("auto", "what one step holds: prefill_first, interleave (decode after each "
                                      "prefill step while prompts wait), mixed (decodes and prefill chunks in "
                                      "one step); auto: mixed where decodes run (the best ITL tail, as vLLM "
                                      "does), prefill_first on prefill workers", choices=("auto", *SCHEDULE_POLICIES))
    prompt_order: str = setting(
        "shortest", "the order waiting prompts are admitted in, within a priority class: shortest: by arrival plus "
                    "the prompt's time to compute alone at the learned prefill speed, so a burst's short prompts go "
                    "first (a prompt under way too, by the tokens it has left) and a prompt is passed only by prompts "
                    "that arrived before it would have finished alone (no starvation); fcfs: by arrival (vLLM's "
                    "default)", choices=PROMPT_ORDERS)
    prompt_tokens_with_decodes: int | None = setting(
        None, "prompt tokens one step may compute while sequences decode in it (a prompt chunk delays each of "
              "them by its time, as Sarathi-Serve sizes chunks for the inter-token latency); none: decode workers "
              "(which run prompts only when the router has them prefill locally) size it from their learned step "
              "costs so that a chunk adds about half a decode step's time, other roles use the step budget")
    role: str = setting("both", "both (colocated), prefill or decode", choices=ROLES)
    num_threads: int | None = setting(None, "torch intra-op threads; none: torch's choice", aliases=("--threads",))
    batch_invariant: bool = setting(True, "CPU (native kernels): each sequence's logits independent of the batch around "
                                     "it, the chunk budget and prefill vs decode (one GEMM kernel for every row "
                                     "count, every query row through the paged decode attention kernel), so "
                                     "greedy output is the same alone, batched, disaggregated and after a "
                                     "migration; off: the row-count-tuned kernels where the CPU has faster ones "
                                     "(AMX: its GEMM and prefill attention, faster where prompts are long); "
                                     "bf16 on AVX512-BF16 without AMX keeps the invariant ones, the fastest there")
    enforce_eager: bool = setting(False, "CUDA: no graph capture for decode")
    quantization: str | None = setting(None, "w8a16: int8 weights with per-output-channel scales",
                                  choices=QUANTIZATIONS)
    seed: int = setting(0, "sampling seed of requests without their own")
    tensor_parallel_size: int = setting(1, "ranks one worker splits the model over (heads, MLP, vocabulary); "
                                      "the engine starts and stops the other ranks' processes (gloo on CPU, "
                                      "NCCL on CUDA: one GPU per rank)")
    speculative_config: SpeculativeConfig | None = setting(
        None, "speculative decoding, as vLLM's: a JSON object (a dict in Python), e.g. "
              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
              "\"prompt_lookup_min\": 2}': each decoding sequence drafts tokens by prompt lookup over its own "
              "tokens and one forward pass verifies them; greedy requests only (sampled ones decode plainly); "
              "none: off", metavar="JSON")
    tp_collective_timeout_s: float = setting(60.0, "tensor parallelism: seconds a collective may wait for the other "
                                              "ranks before the worker fails (a rank died or stalled) and frees "
                                              "every request's blocks; must exceed the longest step "
                                              f"(range {TP_TIMEOUT_RANGE_S[0]:g} to {TP_TIMEOUT_RANGE_S[1]:g})")

    def __post_init__(self) -> None:
        _check_choice("role", self.role, ROLES)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)   # a dict or JSON: the dataclass
        _check_choice("schedule_policy", self.schedule_policy, ("auto", *SCHEDULE_POLICIES))
        _check_choice("prompt_order", self.prompt_order, PROMPT_ORDERS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("compute_dtype", self.compute_dtype, DTYPES)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("kv_host_cache_bytes", self.kv_host_cache_bytes, 0)
        _check_int("kv_disk_cache_bytes", self.kv_disk_cache_bytes, 0)
        if not isinstance(self.kv_disk_cache_dir, str):
            raise ValueError(f"kv_disk_cache_dir must be a directory path (a string, empty: off), "
                             f"got {self.kv_disk_cache_dir!r}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, 1)
        low, high = TP_TIMEOUT_RANGE_S
        if isinstance(self.tp_collective_timeout_s, bool) or not isinstance(self.tp_collective_timeout_s, (int, float)) \
                or not low <= self.tp_collective_timeout_s <= high:
            raise ValueError(f"tp_collective_timeout_s must be a number of seconds in [{low:g}, {high:g}], "
                             f"got {self.tp_collective_timeout_s!r}")
        if self.prompt_tokens_with_decodes is not None:
            _check_int("prompt_tokens_with_decodes", self.prompt_tokens_with_decodes, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def default_step_tokens(self, on_cpu: bool) -> int:
        """The step budget when max_num_batched_tokens is left to the engine: smaller on a CPU
        prefill worker, where batching prompts saves little (compute-bound steps, a fixed part
        of ~2 ms) while every prompt of a step waits for the step's end."""
        return CPU_PREFILL_STEP_TOKENS if on_cpu and self.role == "prefill" else STEP_TOKENS

    @property
    def policy(self) -> str:
        """The schedule policy in force ("auto" resolved by role)."""
        if self.schedule_policy != "auto":
            return self.schedule_policy
        return "prefill_first" if self.role == "prefill" else "mixed"

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments, naming any unknown field."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown config field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(model=model, **kwargs)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
