"""How one worker process serves (the `pdserve worker` / `prefill` / `decode` commands and Ray's
worker actors build it): its address, metrics endpoint, KV sender, credentials and settings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.services.common.security import Credentials
from pdserve.services.workers.config import WorkerConfig

if TYPE_CHECKING:
    from pdserve.services.kv_transfer.base import KVSender


@dataclass(slots=True)
class WorkerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = ""
    metrics_port: int | None = None   # Prometheus /metrics; None: no endpoint
    metrics_token: str | None = None  # scrapes must send it as a bearer token
    kv_address: str = ""              # advertised as WorkerStatus.kv_address ("": the Worker address)
    kv_sender: "KVSender | None" = None  # prefill: how KV blocks leave (None: gRPC)
    credentials: Credentials = field(default_factory=Credentials)
    config: WorkerConfig = field(default_factory=WorkerConfig)
