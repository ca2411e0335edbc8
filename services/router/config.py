"""The router's settings: its own (RouterConfig) and how it generates (GenerationOptions: retries,
routing, admission, SLO targets, sessions); request limits are services/api/request_limits.RequestLimits.
Torch-free, so that the CLI builds its flags without importing the router."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.settings import setting
from pdserve.services.common.topology import drain_timeout_setting, otlp_endpoint_setting, otlp_insecure_setting
from pdserve.services.router.slo import MAX_TARGET_MS

ROUTING_POLICIES = ("kv-aware", "load")
DEFAULT_MAX_KEYS = 1 << 20   # prefix-cache keys per worker: ~100 MB of Python objects at most, far above a real pool's blocks
DISAGGREGATION_MODES = ("always", "conditional")
# A queued request holds no KV, only itself: its prompt's text and token ids (a Python list, ~36 B
# a token), its connection and task: ~120 KB for 1,024 tokens over HTTP (measured: the router's
# RSS grew 23 MB with 200 of `vllm bench serve`'s random 1,024-token requests queued). 4,096 of
# them are ~0.5 GB (prompts at SmolLM2's 8,192-token max_model_len, scaled: ~4 GB); the bound takes
# the bursts clients send by default (vllm bench serve: 1,000 at once) with room to spare.
DEFAULT_MAX_QUEUED = 4096


@dataclass(slots=True)
class RouterConfig:
    drain_timeout_s: float = drain_timeout_setting()
    ready_timeout_s: float = setting(120.0, "workers must be up this soon after start")
    http_port: int | None = setting(None, "serve the OpenAI-compatible HTTP API on this port, on --host "
                                          "(none: no HTTP)")
    served_model_name: tuple[str, ...] | None = setting(
        None, "model name(s) of the HTTP API, as vLLM's: the first is the one reported, every one is accepted; "
              "none: the --model argument as given (the default model: its directory's name). The checkpoint "
              "directory's name is accepted too", metavar="NAME")
    otlp_endpoint: str | None = otlp_endpoint_setting()
    otlp_insecure: bool = otlp_insecure_setting()
    api_keys_file: str | None = setting(
        None, "file of named API keys with their grants, one a line: NAME KEY [min_priority=N] (mode 0600; "
              "services/api/principals.py); each key's name is its holder's fair-share key and request-id scope",
        metavar="FILE")
    min_client_priority: int = setting(
        0, "the most urgent priority (lowest value) a client may ask for unless its API key grants lower: "
           "0 lets clients only lower their own priority")
    allowed_hosts: str | None = setting(None, "comma-separated Host names the HTTP API answers without an API key, "
                                              "besides localhost and IP addresses (DNS rebinding needs a name); "
                                              "'*': any")

    def __post_init__(self) -> None:
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.served_model_name is not None:
            names = (self.served_model_name,) if isinstance(self.served_model_name, str) else self.served_model_name
            self.served_model_name = tuple(names)
            if not self.served_model_name or any(not isinstance(n, str) or not n.strip() for n in names):
                raise ValueError(f"served_model_name must be one or more non-empty names, got {names!r}")
        if self.allowed_hosts is not None and not all(h.strip() for h in self.allowed_hosts.split(",")):
            raise ValueError(f"allowed_hosts must be comma-separated names, got {self.allowed_hosts!r}")


@dataclass(slots=True)
class GenerationOptions:
    migration_limit: int = setting(3, "times one request may move to another worker after a fault before it fails")
    stall_timeout_s: float = setting(10.0, "a worker stream silent this long is treated as failed (and the request "
                                           "migrates)")
    queue_timeout_s: float | None = setting(
        None, "longest wait for decode capacity, then 429 / RESOURCE_EXHAUSTED with a retry hint; none or 0: no "
              "limit of its own (as vLLM): a queued request waits until capacity frees, its gRPC deadline passes or "
              "its client goes away, holding no KV meanwhile")
    max_queued_requests: int = setting(
        DEFAULT_MAX_QUEUED, "requests waiting for decode capacity (each holds its prompt and its connection, "
                            "~120 KB for 1,024 tokens, no KV); one more is refused at once (429 / "
                            "RESOURCE_EXHAUSTED naming this limit, with a retry hint)")
    kv_lease_ms: int = setting(0, "idle KV lease asked for each reservation (0: the decode worker's default)")
    worker_wait_s: float = setting(
        60.0, "a role with no healthy worker (a restart) holds the requests that need it for at most this long, "
              "counted from when its last worker was lost, and every waiter by the same time (or its own "
              "deadline, sooner); then they fail UNAVAILABLE. `pdserve up` sets it from its workers' measured "
              "restart time", aliases=("--worker-wait",))
    routing: str = setting(
        "kv-aware", "how workers are chosen: kv-aware (by estimated cost to serve: uncached prompt tokens, from the "
                    "workers' prefix-cache events, queue and running load, KV blocks to ship) or load (fewest in "
                    "flight / queued prompt tokens)", choices=ROUTING_POLICIES)
    disaggregation: str = setting(
        "conditional", "conditional: a prompt is prefilled on the chosen decode worker instead of a prefill worker "
                       "when the learned costs say it is cheaper (see /metrics and the response timings); always: "
                       "every prompt is prefilled on a prefill worker",
        choices=DISAGGREGATION_MODES)
    itl_weight: float = setting(0.1, "conditional disaggregation: ms of time to first token worth one ms of delay "
                                     "added to each sequence decoding on the worker that would prefill locally "
                                     "(0.1: a decode worker takes prompts in a burst while its sequences stay far "
                                     "inside their TPOT; docs/benchmarks.md, the production trace)")
    cache_affinity_weight: float = setting(
        1.0, "kv-aware routing: ms of cost per ms of prefill time of the prefix blocks another decode worker holds "
             "and the candidate lacks (0: only the transfer counts; 1: a prefix leaves its worker only when that "
             "worker's extra decode load costs more than computing the prefix again)")
    kv_index_max_keys: int = setting(DEFAULT_MAX_KEYS, "kv-aware routing: prefix-cache keys remembered per worker "
                                                       "(least recently seen dropped)")
    slo_admission: bool = setting(False, "admit by prediction: refuse at once (429 / RESOURCE_EXHAUSTED, with a "
                                         "retry hint) a request predicted to miss its TTFT target, offer a decode "
                                         "worker only requests that keep every TPOT target there, and shed a "
                                         "request still queued past its TTFT target")
    slo_ttft_ms: float = setting(0.0, "the deployment's time-to-first-token target in ms (0: none); a request's "
                                      "own (slo_ttft_ms) wins")
    slo_tpot_ms: float = setting(0.0, "the deployment's time-per-output-token target in ms (0: none); a request's "
                                      "own (slo_tpot_ms) wins")
    slo_shed: bool = setting(True, "with --slo-admission: shed a request still waiting for decode capacity once its "
                                   "TTFT target has passed, rather than serve it late")
    session_ttl_s: float = setting(600.0, "multi-turn sessions (session_id, else user): for this long after a turn, "
                                          "the next turn may prefill on the decode worker that holds the "
                                          "conversation's KV, computing only its new tokens (0: off)")
    max_sessions: int = setting(100_000, "sessions remembered (least recently used dropped)")

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation must be one of {DISAGGREGATION_MODES}, got {self.disaggregation!r}")
        if self.itl_weight < 0:
            raise ValueError(f"itl_weight must be >= 0, got {self.itl_weight}")
        if self.cache_affinity_weight < 0:
            raise ValueError(f"cache_affinity_weight must be >= 0, got {self.cache_affinity_weight}")
        if self.kv_index_max_keys < 1:
            raise ValueError(f"kv_index_max_keys must be >= 1, got {self.kv_index_max_keys}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if not 0 <= getattr(self, name) <= MAX_TARGET_MS:
                raise ValueError(f"{name} must be in [0, {MAX_TARGET_MS:g}] ms, got {getattr(self, name)}")
        for name in ("migration_limit", "max_queued_requests", "kv_lease_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.session_ttl_s < 0 or self.max_sessions < 1:
            raise ValueError(f"session_ttl_s must be >= 0 and max_sessions >= 1, got {self.session_ttl_s}, "
                             f"{self.max_sessions}")
        for name in ("stall_timeout_s", "worker_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.queue_timeout_s is not None and not self.queue_timeout_s >= 0:
            raise ValueError(f"queue_timeout_s must be >= 0 (0 or none: no limit), got {self.queue_timeout_s}")
        if self.queue_timeout_s == 0:
            self.queue_timeout_s = None
