"""Errors the router answers with, whatever the protocol (gRPC status or HTTP)."""
from __future__ import annotations

import re

from pdserve.engine.quoting import capped


# A worker's own refusals, whose text pdserve wrote (a lease that expired, a block that failed its
# check, no capacity); other endings (UNAVAILABLE, INTERNAL, UNKNOWN) carry transport or exception text.
WORKER_STATUSES_SHOWN = frozenset({"DEADLINE_EXCEEDED", "DATA_LOSS", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                   "OUT_OF_RANGE", "ABORTED"})
_ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[\w.-]+):\d{2,5}\b")


class RouterError(Exception):
    """A request ends with this status. ``code`` is a gRPC status name; ``retry_after_s`` a hint
    for RESOURCE_EXHAUSTED (sent as trailing metadata ``retry-after-ms``, or HTTP Retry-After).

    ``message`` is what the client reads: it names the field at fault (``field``, HTTP's
    ``param``) and the limit, never a worker's address or internal exception text; those go in
    ``detail``, which only the router's log sees. ``too_large``: a size limit (HTTP 413)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None, *, field: str | None = None,
                 too_large: bool = False, detail: str | None = None) -> None:
        message = capped(message)   # whatever a check quoted, the client reads a bounded message
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.field = field
        self.too_large = too_large
        self.detail = detail

    def public_message(self, request_id: str | None) -> str:
        """The client's text: the message, plus the request id when the details are in the log."""
        if self.detail is None or not request_id:
            return self.message
        return f"{self.message} (request id {request_id}; the router's log has the details)"


class WorkerFailure(Exception):
    """A worker failed or stalled mid-request: the request may move to another worker."""

    def __init__(self, address: str, code: str, message: str) -> None:
        super().__init__(f"{address}: {code}: {message}")
        self.address = address
        self.code = code
        self.message = message

    def client_message(self) -> str:
        """What the client reads when its request failed here for good: the worker's own reason
        where pdserve wrote it (a lease that expired, a block that failed its check), addresses
        taken out; else a generic line (transport or exception text stays in the router's log)."""
        if self.code in WORKER_STATUSES_SHOWN and self.message:
            return f"the request failed on its workers: {_ADDRESS.sub('a worker', self.message)[:300]}"
        return "the request failed on its workers"
