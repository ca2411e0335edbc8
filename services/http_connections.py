"""Bounds on the HTTP API's connections that uvicorn lacks.

uvicorn times a connection out only between requests (its keep-alive timer starts when a
response completes), so a socket that connects and never sends a complete request head holds a
file descriptor for ever, and it accepts any number of them. ``BoundedHttpToolsProtocol`` (its
httptools protocol, which the router uses) closes a connection whose first request head has not
arrived within ``head_timeout_s``, and closes at once any connection past ``max_connections``.
Slow bodies are bounded by the API itself (``--http-body-timeout-s``).
"""
from __future__ import annotations

import asyncio
import resource
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HTTP_CONNECTIONS = 1024     # open connections at once (at most a quarter of the fd limit); more are
                                # closed as they are accepted
HEAD_TIMEOUT_S = 10.0           # from accept to a complete first request head


def connection_cap() -> int:
    """MAX_HTTP_CONNECTIONS, or a quarter of this process's file-descriptor limit if lower, so
    idle sockets never starve gRPC accepts and shared-memory opens."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_HTTP_CONNECTIONS
    return max(16, min(MAX_HTTP_CONNECTIONS, soft // 4))


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_connections = connection_cap()
    head_timeout_s = HEAD_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.close()
            return
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def on_headers_complete(self) -> None:
        self._cancel_head_deadline()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)
