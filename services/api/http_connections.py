"""Bounds on the HTTP API's connections that uvicorn lacks.

uvicorn times a connection out only between requests (its keep-alive timer starts when a
response completes), so a socket that connects and never sends a complete request head holds a
file descriptor for ever, and it accepts any number of them. ``BoundedHttpToolsProtocol`` (its
httptools protocol, which the router uses) closes a connection whose first request head has not
arrived within ``head_timeout_s``, and closes at once any connection past ``max_connections``
(``bounded_protocol``: fixed when the server starts, from the file-descriptor limit then).
Slow bodies are bounded by the API itself (``--http-body-timeout-s``). ``RequestGuard``: the API
key, Host and Content-Type checks made on each request's head, before routing.
"""
from __future__ import annotations

import asyncio
import ipaddress
import resource
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.services.api.openai_protocol import HTTPError
from pdserve.services.api.principals import ApiKeys

MAX_HTTP_CONNECTIONS = 4096     # open connections at once (at most a quarter of the fd limit); more are
                                # closed as they are accepted. As many as the router queues requests by
                                # default (max_queued_requests): a burst of one connection per request fits
HEAD_TIMEOUT_S = 10.0           # from accept to a complete first request head
OPEN_PATHS = ("/health",)              # no API key, no Host check (orchestrators probe it)
JSON_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")   # POSTs of JSON bodies
LOOPBACK_NAMES = ("localhost",)        # besides IP addresses: DNS rebinding needs a name


def connection_cap(soft_fd_limit: int | None = None) -> int:
    """MAX_HTTP_CONNECTIONS, or a quarter of the soft file-descriptor limit (this process's if not
    given) if lower, so idle sockets never starve gRPC accepts and shared-memory opens. The router
    raises its limit at start-up (services/common/fd_limit.py), before its HTTP server asks."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if soft_fd_limit is None else soft_fd_limit
    if soft == resource.RLIM_INFINITY:
        return MAX_HTTP_CONNECTIONS
    return max(16, min(MAX_HTTP_CONNECTIONS, soft // 4))


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_connections = MAX_HTTP_CONNECTIONS   # a server's own: bounded_protocol()
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


def bounded_protocol(max_connections: int | None = None) -> type[BoundedHttpToolsProtocol]:
    """The protocol class a server uses, its cap fixed when the server starts (connection_cap()
    if not given), not when this module was imported: the fd limit may have been raised since."""
    cap = connection_cap() if max_connections is None else max_connections
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"max_connections": cap})


class RequestGuard:
    """The checks made on a request's head, before routing or reading its body.
    allowed_hosts: see RouterConfig."""

    def __init__(self, api_key: ApiKeys | str | None, allowed_hosts: str | None) -> None:
        self.keys = ApiKeys.of(api_key)
        self.allowed_hosts = frozenset(h.strip().lower().rstrip(".") for h in (allowed_hosts or "").split(",")
                                       if h.strip())

    def refusal(self, scope) -> HTTPError | None:
        """What a browser could do to a server on the user's machine is refused here. With an
        API key set, the key (compared in constant time; a web page does not have it). Without
        one, the Host: a DNS-rebinding page reaches 127.0.0.1 under its own name, so only
        localhost, IP addresses and --allowed-hosts are answered. Generation and (de)tokenize
        requests must be application/json: a page can POST text/plain (or no type) cross-origin without a
        CORS preflight, never JSON."""
        headers = {k: v for k, v in scope.get("headers", ()) if k in (b"authorization", b"host", b"content-type")}
        if self.keys.required:
            if self.keys.identify(headers.get(b"authorization")) is None:
                return HTTPError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        elif b"host" in headers and not self.host_allowed(headers[b"host"].decode("latin-1")):
            return HTTPError(421, f"Host header {headers[b'host'].decode('latin-1')[:100]!r} is not served without "
                                  f"an API key: use localhost or an IP address, or start the router with "
                                  f"--allowed-hosts NAME", "Host", "host_not_allowed")
        if scope.get("method") == "POST" and scope["path"] in JSON_PATHS:
            given = headers.get(b"content-type", b"").decode("latin-1")
            if given.split(";", 1)[0].strip().lower() != "application/json":
                return HTTPError(415, f"Content-Type header must be application/json, got {given[:100]!r}",
                                 "Content-Type", "unsupported_media_type")
        return None

    def host_allowed(self, host: str) -> bool:
        if "*" in self.allowed_hosts:
            return True
        name = host[1:].split("]", 1)[0] if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 \
            else host
        name = name.lower().rstrip(".")
        if name in LOOPBACK_NAMES or name in self.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True
