"""A worker's own settings (the engine's are EngineConfig): torch-free, so that the CLI builds its
flags without importing the worker (services/workers/worker_process.py)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv.handoff import LeasePolicy
from pdserve.engine.settings import setting
from pdserve.services.common.proofs import is_host_port
from pdserve.services.common.topology import drain_timeout_setting, otlp_endpoint_setting, otlp_insecure_setting
from pdserve.services.kv_transfer import shared_memory

KV_COMPRESSION_MODES = ("auto", "off", "lossless", "int8")   # services/kv_transfer/wire_codec.MODES
KV_DATA_PLANES = ("tcp", "grpc")
ENGINE_STALL_EXIT_CODE = 75   # a worker whose engine loop stalled exits with this (EX_TEMPFAIL): restart it
ENGINE_STALL_RANGE_S = (1.0, 3600.0)   # engine_stall_timeout_s: above the slowest step, below "hung"


@dataclass(slots=True)
class WorkerConfig:
    """A worker's own settings (the engine's are EngineConfig)."""

    drain_timeout_s: float = drain_timeout_setting()
    kv_lease_idle_s: float = setting(10.0, "decode: a reservation whose KV makes no progress this long is freed")
    kv_lease_max_s: float = setting(300.0, "decode: no reservation lives longer (prefill: nor do pinned blocks "
                                           "awaiting delivery)")
    kv_shared_memory: bool = setting(True, "KV sends of 1 MiB or more between workers on this host's loopback go "
                                           "through /dev/shm (0600 segments); the gRPC stream carries only headers. "
                                           "Both ends must allow it and share the directory; otherwise (or when a "
                                           "segment cannot be written) KV goes inline")
    kv_shared_memory_dir: str = setting(shared_memory.SHM_DIR, "the directory (a tmpfs) of KV shared-memory segments; "
                                                               "sender and receiver must name the same")
    kv_shared_memory_max_bytes: int = setting(shared_memory.SHARED_MEMORY_MAX_BYTES,
                                              "prefill: payload bytes in shared-memory segments not yet "
                                              "acknowledged, at most; beyond, KV goes inline")
    kv_compression: str = setting("auto", "prefill: KV wire codec on streamed (not shared-memory) frames. auto: "
                                          "lossless to a decode worker whose measured link is slow enough that "
                                          "it pays (the first transfer to each goes off); int8 (lossy) only when "
                                          "asked (a dtype it cannot take goes lossless). Decode workers take any",
                                  choices=KV_COMPRESSION_MODES)
    kv_advertise_address: str = setting("", "decode: the HOST:PORT prefill workers send this worker's KV to "
                                            "(default: its own --host:--port), e.g. a relay or a translated "
                                            "address on another network")

    kv_data_plane: str = setting("tcp", "KV hand-off over a raw TCP connection (tcp: the decode worker listens on "
                                        "--kv-data-port and a prefill worker sends there, authenticated by the "
                                        "cluster token, mTLS with the --tls-* files) or over the gRPC stream "
                                        "(grpc). Either end set to grpc, or a Ray deployment: gRPC",
                                 choices=KV_DATA_PLANES)
    kv_data_port: int = setting(0, "decode: the TCP port of the KV data plane on --host (0: an ephemeral port, "
                                   "advertised to the router in each reservation)")
    kv_data_max_connections: int = setting(64, "decode: KV data-plane connections served at once; more are refused. "
                                               "A transfer holds one while its blocks flow (a queued request's "
                                               "lease is kept by beats over one shared connection per sender)")
    engine_stall_timeout_s: float = setting(90.0, "a worker whose engine loop completes no step this long while it "
                                                  "has work (an idle one never counts) exits with code "
                                                  f"{ENGINE_STALL_EXIT_CODE}, so that its supervisor (`pdserve up`, "
                                                  "Ray) restarts it and the router migrates its requests; must exceed "
                                                  "the slowest step (a full prompt chunk on a loaded machine) and "
                                                  "--tp-collective-timeout-s (range "
                                                  f"{ENGINE_STALL_RANGE_S[0]:g} to {ENGINE_STALL_RANGE_S[1]:g})")
    otlp_endpoint: str | None = otlp_endpoint_setting()
    otlp_insecure: bool = otlp_insecure_setting()
    router: str = setting("", "join the router at HOST:PORT (its membership API, with the cluster token) and stay "
                              "a member while running: it routes to this worker once healthy, and drains it "
                              "before removing it (`pdserve workers`); a restarted router gets it back",
                          metavar="HOST:PORT")
    advertise_address: str = setting("", "the HOST:PORT a router this worker joins dials it at (default: --host and "
                                         "its bound --port)", metavar="HOST:PORT")

    def __post_init__(self) -> None:
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not 0 < self.kv_lease_idle_s <= self.kv_lease_max_s:   # as LeasePolicy's check, without torch
            raise ValueError(f"kv_lease_idle_s ({self.kv_lease_idle_s}) must be > 0 and <= kv_lease_max_s "
                             f"({self.kv_lease_max_s})")
        for name in ("kv_advertise_address", "router", "advertise_address"):
            value = getattr(self, name)
            if value and not is_host_port(value):
                raise ValueError(f"{name} must be HOST:PORT (port 1-65535), got {value!r}")
        if not 0 <= self.kv_data_port < 65536:
            raise ValueError(f"kv_data_port must be 0-65535, got {self.kv_data_port}")
        low, high = ENGINE_STALL_RANGE_S
        if isinstance(self.engine_stall_timeout_s, bool) or not isinstance(self.engine_stall_timeout_s, (int, float)) \
                or not low <= self.engine_stall_timeout_s <= high:   # NaN too
            raise ValueError(f"engine_stall_timeout_s must be a number of seconds in [{low:g}, {high:g}], "
                             f"got {self.engine_stall_timeout_s!r:.40}")
        if self.kv_data_max_connections < 1:
            raise ValueError(f"kv_data_max_connections must be >= 1, got {self.kv_data_max_connections}")
        if self.kv_shared_memory_max_bytes < 0:
            raise ValueError(f"kv_shared_memory_max_bytes must be >= 0, got {self.kv_shared_memory_max_bytes}")

    @property
    def lease(self) -> LeasePolicy:
        return LeasePolicy(self.kv_lease_idle_s, self.kv_lease_max_s)
