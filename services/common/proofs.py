"""A call's proof of a deployment secret (services/common/security.py's trust model): its format, the
keys derived from the secret, the server names a proof binds, and the cache that lets each proof
in once. No grpc here: the interceptors that send and check proofs are in
services/common/proof_interceptors.py.

A proof is ``v2.<unix_ms>.<nonce>.<target>.<digest>.<mac>``: an HMAC-SHA256, keyed by the
secret, over the method, the server the caller dials (``target``: HOST:PORT, base64), the time,
a random nonce and the SHA-256 of the call's first request message (``digest``). It works once,
within ``PROOF_WINDOW_S`` of the server's clock, at the server it names (``ServerNames``), for
that message only.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import re
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

AUTH_HEADER = "x-pdserve-auth"               # the caller's proof of the cluster token
ADMIN_AUTH_HEADER = "x-pdserve-admin-auth"   # the caller's proof of the admin token (membership changes)
AUTH_REPLY_HEADER = "x-pdserve-auth-reply"   # the server's, in its initial metadata
API_KEY_HEADER = "authorization"            # "Bearer <key>", as OpenAI-style clients send it
PROOF_WINDOW_S = 30.0          # members' clocks agree within this; a proof older (or newer) is refused
REPLAY_CACHE_MAX = 1 << 17     # nonces remembered (~15 MB at most); the oldest go first, see _Nonces
PROOF_VERSION = "v2"
MAX_TARGET_B64 = 344           # a proof's server name: 256 bytes at most, base64
DIGEST_CHARS = 43              # a SHA-256, base64 without padding


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether host binds every interface (0.0.0.0, ::, or empty)."""
    host = host.strip("[]")
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def host_of(address: str) -> str:
    """The host part of HOST:PORT or [V6]:PORT."""
    return address.rsplit(":", 1)[0].strip("[]") if ":" in address else address


def is_host_port(address: str) -> bool:
    """HOST:PORT or [V6]:PORT with a host and a port in 1-65535."""
    host, sep, port = address.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _text(value: str | bytes) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def _digest(message: bytes | bytearray | memoryview) -> str:
    return _b64(hashlib.sha256(message).digest())


_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,252})")


def is_dial_address(address: str) -> bool:
    """HOST:PORT a member may be told to dial: a DNS name (letters, digits, '.', '-', '_'), an
    IPv4 address or a bracketed IPv6 one, and a port in 1-65535. No scheme, path, user or
    gRPC resolver prefix (``dns:``, ``unix:``, ``ipv4:``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    return _HOSTNAME.fullmatch(host) is not None


def proof_target(address: str) -> str:
    """The server name a proof binds: the HOST:PORT the caller dials, the host lowercased and an
    IP literal in its canonical form (so ``[::0:1]:5`` and ``[::1]:5`` name one server)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep:
        return address.strip().lower()
    host = host.strip("[]").lower()
    try:
        ip = ipaddress.ip_address(host)
        host = str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)
    except ValueError:
        pass
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class ServerNames:
    """The HOST:PORT names a server answers to; a proof naming any other server is refused.

    Its bound host and port (any loopback name when it binds loopback; any host at its port when
    it binds every interface, a wildcard needing mutual TLS: what it is dialed at is not known to
    it), and the addresses it is advertised at (``--advertise-address``, ``--kv-advertise-address``:
    a relay or a translated address)."""

    host: str
    port: int
    advertised: frozenset[str] = frozenset()

    @classmethod
    def of(cls, host: str, port: int, advertised: Sequence[str] = ()) -> "ServerNames":
        return cls(host.strip("[]").lower(), port, frozenset(proof_target(a) for a in advertised if a))

    def accepts(self, target: str) -> bool:
        if target in self.advertised:
            return True
        host, sep, port = target.rpartition(":")
        if not sep or port != str(self.port):
            return False
        host = host.strip("[]")
        if is_wildcard(self.host) or host == self.host:
            return True
        return is_loopback(self.host) and is_loopback(host)


@dataclass(frozen=True, slots=True)
class CallProof:
    """One call's proof (its metadata) and the check of the server's reply to it."""

    metadata: tuple[tuple[str, str], ...] = ()
    expected: tuple[str, ...] = ()          # the replies that vouch for the server; (): nothing to check

    def verify(self, initial_metadata: Any) -> bool:
        """The server's initial metadata answers this call's nonce (always true without a token)."""
        if not self.expected:
            return True
        given = next((_text(v) for k, v in initial_metadata or () if k == AUTH_REPLY_HEADER), None)
        return given is not None and any(hmac.compare_digest(given.encode(), e.encode()) for e in self.expected)

    def __add__(self, other: "CallProof") -> "CallProof":
        return CallProof((*self.metadata, *other.metadata), (*self.expected, *other.expected))


@dataclass(frozen=True, slots=True)
class ProofClaim:
    """What a proof with a valid MAC says: when, its nonce, the server it names, the digest of
    the call's first message."""

    ms: int
    nonce: str
    target: str
    digest: str


class ClusterKey:
    """The keys derived from a secret: one for callers' proofs, one for servers' replies. realm
    "admin": the router's membership-admin token, in a header of its own."""

    def __init__(self, token: str, realm: str = "") -> None:
        t, label = token.encode(), f"{realm} " if realm else ""
        self._caller = hmac.digest(t, f"pdserve {PROOF_VERSION} {label}caller proof".encode(), "sha256")
        self._server = hmac.digest(t, f"pdserve {PROOF_VERSION} {label}server proof".encode(), "sha256")
        self.header = ADMIN_AUTH_HEADER if realm == "admin" else AUTH_HEADER

    def _mac(self, key: bytes, text: str) -> str:
        return _b64(hmac.digest(key, text.encode(), "sha256"))

    def prove(self, method: str, target: str = "", message: bytes | bytearray | memoryview = b"",
              now_ms: int | None = None, nonce: str | None = None) -> CallProof:
        """A proof for one call of method to the server dialed at target (HOST:PORT; "" where the
        method names its server, a Ray actor's), whose first request message serializes to message."""
        ms = int(time.time() * 1000) if now_ms is None else now_ms
        nonce = nonce or secrets.token_urlsafe(12)
        target, digest = proof_target(target) if target else "", _digest(message)
        mac = self._mac(self._caller, f"{PROOF_VERSION}|{method}|{target}|{ms}|{nonce}|{digest}")
        value = f"{PROOF_VERSION}.{ms}.{nonce}.{_b64(target.encode())}.{digest}.{mac}"
        return CallProof(((self.header, value),), (self.reply(method, nonce),))

    def reply(self, method: str, nonce: str) -> str:
        return self._mac(self._server, f"reply|{method}|{nonce}")

    def check(self, method: str, value: str) -> ProofClaim | None:
        """What a proof for method claims, if its MAC is this key's (None: malformed or wrong MAC;
        the server it names, its time, nonce and message are the caller's checks)."""
        parts = value.split(".")
        if len(parts) != 6 or parts[0] != PROOF_VERSION or not parts[1].isdigit() or len(parts[1]) > 16 \
                or not 8 <= len(parts[2]) <= 64 or len(parts[3]) > MAX_TARGET_B64 or len(parts[4]) != DIGEST_CHARS:
            return None
        try:
            target = base64.urlsafe_b64decode(parts[3] + "=" * (-len(parts[3]) % 4)).decode("ascii")
        except (ValueError, UnicodeDecodeError):
            return None
        expected = self._mac(self._caller, f"{PROOF_VERSION}|{method}|{target}|{parts[1]}|{parts[2]}|{parts[4]}")
        if not hmac.compare_digest(expected.encode(), parts[5].encode()):
            return None
        return ProofClaim(int(parts[1]), parts[2], target, parts[4])


class _Nonces:
    """Nonces of accepted proofs, each refused a second time. Bounded: past ``limit`` the oldest
    are forgotten and the floor rises to the newest forgotten time, below which every proof is
    refused (so a forgotten nonce cannot be replayed either)."""

    def __init__(self, window_ms: int, limit: int = REPLAY_CACHE_MAX) -> None:
        self.window_ms, self.limit = window_ms, limit
        self.order: deque[tuple[int, str]] = deque()
        self.seen: set[str] = set()
        self.floor_ms = 0

    def admit(self, ms: int, nonce: str, now_ms: int) -> bool:
        if abs(now_ms - ms) > self.window_ms or ms <= self.floor_ms or nonce in self.seen:
            return False
        while self.order and (self.order[0][0] < now_ms - self.window_ms or len(self.order) >= self.limit):
            old_ms, old = self.order.popleft()
            self.seen.discard(old)
            if old_ms >= now_ms - self.window_ms:   # forgotten while still in the window
                self.floor_ms = max(self.floor_ms, old_ms)
        if ms <= self.floor_ms:
            return False
        self.order.append((ms, nonce))
        self.seen.add(nonce)
        return True


class ProofCheck:
    """The server side of a proof outside gRPC (a Ray actor's control method, whose method
    string names the actor): a valid proof for the method and its message, fresh, and used once."""

    def __init__(self, key: ClusterKey, window_s: float = PROOF_WINDOW_S) -> None:
        self.key = key
        self.nonces = _Nonces(int(window_s * 1000))

    def verify(self, method: str, value: object, message: bytes = b"") -> bool:
        claim = self.key.check(method, value) if isinstance(value, str) and value else None
        return claim is not None and claim.target == "" \
            and hmac.compare_digest(claim.digest.encode(), _digest(message).encode()) \
            and self.nonces.admit(claim.ms, claim.nonce, int(time.time() * 1000))
