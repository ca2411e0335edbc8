"""The router's own settings (request limits are services/request_checks.RequestLimits, generation's
services/generation.GenerationOptions): torch-free, so that the CLI builds its flags without
importing the router."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.settings import setting
from pdserve.services.common.topology import drain_timeout_setting, otlp_endpoint_setting, otlp_insecure_setting


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
