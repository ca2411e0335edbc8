"""Ports a supervisor holds for its children, so that no other local user can take one.

`pdserve up` restarts a dead child on the same port. Between the death and the restart a port
that nobody holds could be bound by any local user, who would then receive the router's
reconnecting calls (and, on the router's ports, clients' API keys). So the supervisor reserves
every port it hands out for the deployment's lifetime: a socket bound with SO_REUSEPORT (and
*not* SO_REUSEADDR) on the IPv6 wildcard, dual-stack, which never listens. Linux then lets only
sockets of the same user that set SO_REUSEPORT too bind the port, on any address: the child's
servers do (``reuse_port``), every other user gets EADDRINUSE, with or without SO_REUSEADDR or
SO_REUSEPORT (tests/e2e/test_internal_plane.py tries each as uid ``nobody``). A reserved port is
never handed out twice by the kernel (port 0 skips it) nor used by outgoing connections.

The child learns which of its ports are reserved from ``PDSERVE_RESERVED_PORTS``; a port not
listed is bound exclusively, as before (a second server on a busy port fails).
"""
from __future__ import annotations

import errno
import socket

from pdserve.engine.settings import ENV
from pdserve.services.common.topology import DEFAULT_HOST

RESERVED_PORTS_ENV = ENV.RESERVED_PORTS.name


def reuse_port(port: int) -> bool:
    """Whether this process's parent reserved port for it (then servers bind it with SO_REUSEPORT)."""
    if port == 0:
        return False
    return port in ENV.RESERVED_PORTS.get()


def _reservation_socket(port: int) -> socket.socket:
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        host = "::"
    except OSError:   # no IPv6 here: the IPv4 wildcard
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        host = "0.0.0.0"
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str = DEFAULT_HOST) -> int:
    """A port free on host now (unreserved: for tests and for ports a child binds at once)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PortReservations:
    """The ports one supervisor holds, until close()."""

    def __init__(self) -> None:
        self._sockets: dict[int, socket.socket] = {}

    def reserve(self, port: int = 0) -> int:
        """Hold port (0: a free one, chosen by the kernel) and return it. OSError(EADDRINUSE) when
        something else holds it."""
        if port and port in self._sockets:
            return port
        try:
            sock = _reservation_socket(port)
        except OSError as exc:
            raise OSError(exc.errno or errno.EADDRINUSE, f"port {port} is already in use ({exc.strerror})") from None
        bound = sock.getsockname()[1]
        self._sockets[bound] = sock
        return bound

    @property
    def ports(self) -> list[int]:
        return list(self._sockets)

    def env(self, ports: list[int]) -> dict[str, str]:
        """The environment telling a child which of its ports are reserved."""
        held = [str(p) for p in ports if p in self._sockets]
        return {RESERVED_PORTS_ENV: ",".join(held)} if held else {}

    def close(self) -> None:
        sockets, self._sockets = self._sockets, {}
        for sock in sockets.values():
            sock.close()
