"""Errors the router answers with, whatever the protocol (gRPC status or HTTP)."""
from __future__ import annotations


class RouterError(Exception):
    """A request ends with this status. ``code`` is a gRPC status name; ``retry_after_s`` a hint
    for RESOURCE_EXHAUSTED (sent as trailing metadata ``retry-after-ms``, or HTTP Retry-After)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class WorkerFailure(Exception):
    """A worker failed or stalled mid-request: the request may move to another worker."""

    def __init__(self, address: str, code: str, message: str) -> None:
        super().__init__(f"{address}: {code}: {message}")
        self.address = address
        self.code = code
        self.message = message
