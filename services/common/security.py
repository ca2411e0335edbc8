"""Who may call what: the cluster token of the internal plane, the router's API key, mutual TLS.

Trust model (docs/architecture.md): clients reach only the router's public API, with an API
key when one is set. The internal plane (the worker services and KV transfer) accepts only
members of the deployment, and members trust only each other:

- The cluster token never goes on the wire. Every internal call carries a fresh proof of it,
  ``x-pdserve-auth: v2.<unix_ms>.<nonce>.<target>.<digest>.<mac>``: an HMAC-SHA256, keyed by the
  token, over the method, the server the caller dials (``target``, HOST:PORT), the time, a random
  nonce and the SHA-256 of the call's first request message (``digest``). The server checks it in
  constant time: the MAC, that it names this server (``ServerNames``), within
  ``PROOF_WINDOW_S`` of its own clock, only once (a bounded cache of recent nonces), and, before
  any work, that the first message's bytes hash to the digest (for a request stream, its first
  message, awaited at most ``FIRST_MESSAGE_WAIT_S``). A proof seen by one member (or on the path)
  so works nowhere else, and for no other message.
- The server proves itself back before its first message: initial metadata
  ``x-pdserve-auth-reply``, an HMAC over the client's nonce under a key of its own. Clients
  (the router's channels, the prefill worker's KV streams) drop a response that lacks it, so a
  process that took a member's port receives no token and hands no invented token to a user.
- With TLS configured every channel is mutually authenticated against the deployment's CA too.
- Membership changes (``MEMBERSHIP_ADMIN_METHODS``: add, drain, resume, remove, switch role) want a
  proof of the router's admin token instead (``x-pdserve-admin-auth``, the same scheme under keys
  of its own); members hold only the cluster token, with which a worker joins (itself) and lists.
- Health checks stay open and carry nothing secret (orchestrators probe them); at most
  ``MAX_HEALTH_WATCHES`` Watch streams are open at once (services/common/grpc_setup.py).

A refused call gets UNAUTHENTICATED before any validation or allocation. A role refuses to
start without a token unless ``--insecure-no-auth`` is given, and then only on a loopback
address (``require_cluster_token``).

Secrets never travel in argv: the token comes from ``--cluster-token-file`` or the
``PDSERVE_CLUSTER_TOKEN`` environment variable (``pdserve up`` makes a random one per
deployment and hands it to its children through the environment); the admin token likewise from
``--admin-token-file`` or ``PDSERVE_ADMIN_TOKEN`` (``pdserve up`` hands it to its router only).
"""
from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import grpc

from pdserve.engine.settings import ENV
from pdserve.services.common.proof_interceptors import ClusterInterceptor, SyncProof, proving_interceptors
from pdserve.services.common.proofs import CallProof, ClusterKey, _text, host_of, is_loopback, is_wildcard

log = logging.getLogger(__name__)

CLUSTER_TOKEN_ENV = ENV.CLUSTER_TOKEN.name
API_KEY_ENV = ENV.API_KEY.name
ADMIN_TOKEN_ENV = ENV.ADMIN_TOKEN.name
MIN_TOKEN_CHARS = 16
MAX_DRAIN_TIMEOUT_S = 3600.0   # a membership change's drain_timeout_s, at most (finite: no worker drains for ever)
INSECURE_FLAG = "--insecure-no-auth"
INSECURE_PLANE_FLAG = "--insecure-internal-plane"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def read_secret(path: str | os.PathLike | None, env: str, what: str) -> str | None:
    """A secret from a file (first line) or, without one, from the environment; None if neither."""
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {what} file {path}: {exc.strerror}") from None
        if not value:
            raise ValueError(f"{what} file {path} is empty")
    else:
        value = (ENV.named(env).raw() or "").strip()
        if not value:
            return None
    if len(value) < MIN_TOKEN_CHARS:
        raise ValueError(f"{what} must have at least {MIN_TOKEN_CHARS} characters, got {len(value)}")
    return value


def require_cluster_token(credentials: "Credentials", host: str, insecure_no_auth: bool, role: str) -> None:
    """A role (worker, router) starts only with a cluster token, or with --insecure-no-auth on a
    loopback host (warned). ValueError, one line naming the flag and the variable, otherwise."""
    if credentials.cluster_token is not None:
        return
    if not insecure_no_auth:
        raise ValueError(f"the {role} needs the deployment's cluster token: pass --cluster-token-file FILE or set "
                         f"${CLUSTER_TOKEN_ENV} (or {INSECURE_FLAG} to run an open internal plane on loopback)")
    if not is_loopback(host):
        raise ValueError(f"{INSECURE_FLAG} is refused with --host {host}: an open internal plane binds only a "
                         f"loopback address; give a cluster token instead")
    log.warning("%s: the internal plane of this %s is open to every local user (no cluster token)",
                INSECURE_FLAG, role)


def require_secure_internal_plane(credentials: "Credentials", role: str, *, binds: Sequence[str] = (),
                                  dials: Sequence[str] = (), insecure_plane: bool = False) -> None:
    """An internal plane that reaches past loopback (a worker binding a non-loopback --host, a
    router dialing a worker on another host) needs mutual TLS, or --insecure-internal-plane
    (warned: KV, prompts and tokens then travel in clear; blocks stay MACed and the cluster token
    is never sent, only proofs of it). A wildcard bind without TLS is refused even with the flag:
    it would open the plane on every interface, including ones the operator never meant.
    ValueError, one line naming the flags, otherwise."""
    if credentials.tls is not None:
        return
    wildcard = next((h for h in binds if is_wildcard(h)), None)
    if wildcard is not None:
        shown = wildcard or "''"
        raise ValueError(f"the {role} refuses --host {shown} without mutual TLS (even with {INSECURE_PLANE_FLAG}): "
                         f"bind one address, or pass --tls-cert, --tls-key and --tls-ca")
    outside = [h for h in (*binds, *map(host_of, dials)) if not is_loopback(h)]
    if not outside:
        return
    if not insecure_plane:
        verb = "bind" if outside[0] in binds else "reach"
        raise ValueError(f"the {role} would {verb} {outside[0]} (not loopback) without mutual TLS: pass --tls-cert, "
                         f"--tls-key and --tls-ca, or {INSECURE_PLANE_FLAG} on a network you trust")
    log.warning("%s: the internal plane of this %s reaches %s unencrypted (KV blocks stay MACed; prompts and "
                "tokens are readable on the path)", INSECURE_PLANE_FLAG, role, ", ".join(sorted(set(outside))))


@dataclass(frozen=True, slots=True)
class TLSFiles:
    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read TLS file {exc.filename}: {exc.strerror}") from None

    @classmethod
    def from_args(cls, cert: str | None, key: str | None, ca: str | None) -> "TLSFiles | None":
        given = [x for x in (cert, key, ca) if x]
        if not given:
            return None
        if len(given) != 3:
            raise ValueError("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca")
        return cls(Path(cert), Path(key), Path(ca))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Credentials:
    """What this process proves and demands on the internal plane. admin_token: the router's
    membership-admin secret (the router checks it; `pdserve workers` and the planner prove it);
    never a worker's."""

    cluster_token: str | None = None
    tls: TLSFiles | None = None
    admin_token: str | None = None
    key: ClusterKey | None = field(default=None, init=False, repr=False, compare=False)
    admin_key: ClusterKey | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.admin_token and self.admin_token == self.cluster_token:
            raise ValueError("the admin token must differ from the cluster token: every member holds the cluster "
                             "token, and the admin token is what they lack")
        object.__setattr__(self, "key", ClusterKey(self.cluster_token) if self.cluster_token else None)
        object.__setattr__(self, "admin_key", ClusterKey(self.admin_token, "admin") if self.admin_token else None)

    def call_proof(self, method: str | bytes, target: str = "", message: bytes | bytearray | memoryview = b""
                   ) -> CallProof:
        """A fresh proof for one call of method to the server dialed at target (HOST:PORT), whose
        first request message serializes to message (empty without a token)."""
        return self.key.prove(_text(method), target, message) if self.key is not None else CallProof()

    def admin_proof(self, method: str | bytes, target: str = "", message: bytes | bytearray | memoryview = b""
                    ) -> CallProof:
        """As call_proof, of the admin token (empty without one)."""
        return self.admin_key.prove(_text(method), target, message) if self.admin_key is not None else CallProof()

    # ---- servers ----------------------------------------------------------------------
    def server_interceptors(self, only: tuple[str, ...] | None = None) -> list[grpc.aio.ServerInterceptor]:
        """The proof checks for a server's methods (only: those under these prefixes). Bind the
        interceptor to the server's names once it is bound (``ClusterInterceptor.serve_at``;
        services.common.grpc_setup.start_server does)."""
        if self.key is None and self.admin_key is None:
            return []
        return [ClusterInterceptor(self.key, only=only, admin_key=self.admin_key)]

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        cert, key, ca = self.tls.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=require_client_cert)

    # ---- clients ----------------------------------------------------------------------
    def channel(self, address: str, options: Sequence[tuple[str, Any]] = (), *,
                attach_token: bool = True) -> grpc.aio.Channel:
        """An asyncio channel to a member of the deployment, with TLS when configured, proving
        membership on every call (to address, with its message) and checking the server's proof
        before its response is read (attach_token=False: the caller passes
        ``call_proof(method, address, first message).metadata`` and checks the reply itself,
        which saves the interceptors' per-call cost on a hot path)."""
        interceptors = proving_interceptors(self, address) if self.key is not None and attach_token else None
        if self.tls is not None:
            cert, key, ca = self.tls.read()
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)

    def probe_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel for health checks: TLS when configured, no secret at all."""
        if self.tls is not None:
            cert, key, ca = self.tls.read()
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            return grpc.secure_channel(address, creds, options=list(options))
        return grpc.insecure_channel(address, options=list(options))

    def sync_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel (tools, tests) proving membership on every call, and the admin
        token too when this process holds it (`pdserve workers`, the planner); a unary call's
        server must prove itself back."""
        channel = self.probe_channel(address, options)
        if self.key is not None or self.admin_key is not None:
            channel = grpc.intercept_channel(channel, SyncProof(self, address))
        return channel

    # ---- the environment children inherit --------------------------------------------------
    def child_env(self, admin: bool = False) -> dict[str, str]:
        """The secrets a child reads from its environment: the cluster token, and the admin token
        for a router (admin)."""
        env = {CLUSTER_TOKEN_ENV: self.cluster_token} if self.cluster_token else {}
        if admin and self.admin_token:
            env[ADMIN_TOKEN_ENV] = self.admin_token
        return env

    @classmethod
    def load(cls, token_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
             tls_ca: str | None = None, *, admin: bool = False, admin_token_file: str | None = None
             ) -> "Credentials":
        """admin: read the admin token too (admin_token_file, else $PDSERVE_ADMIN_TOKEN): a
        router, `up`, `pdserve workers`, the planner; never a worker."""
        admin_token = read_secret(admin_token_file, ADMIN_TOKEN_ENV, "admin token") \
            if admin or admin_token_file else None
        return cls(read_secret(token_file, CLUSTER_TOKEN_ENV, "cluster token"),
                   TLSFiles.from_args(tls_cert, tls_key, tls_ca), admin_token)
