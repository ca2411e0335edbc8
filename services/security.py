"""Who may call what: the cluster token of the internal plane, the router's API key, mutual TLS.

Trust model (docs/architecture.md): clients reach only the router's public API, with an API
key when one is set. The internal plane (the worker services and KV transfer) accepts only
members of the deployment, and members trust only each other:

- The cluster token never goes on the wire. Every internal call carries a fresh proof of it,
  ``x-pdserve-auth: v1.<unix_ms>.<nonce>.<mac>`` (an HMAC-SHA256, keyed by the token, over the
  method, the time and a random nonce), which the server checks in constant time, within
  ``PROOF_WINDOW_S`` of its own clock, and only once (a bounded cache of recent nonces).
- The server proves itself back before its first message: initial metadata
  ``x-pdserve-auth-reply``, an HMAC over the client's nonce under a key of its own. Clients
  (the router's channels, the prefill worker's KV streams) drop a response that lacks it, so a
  process that took a member's port receives no token and hands no invented token to a user.
- With TLS configured every channel is mutually authenticated against the deployment's CA too.
- Health checks stay open and carry nothing secret (orchestrators probe them); at most
  ``MAX_HEALTH_WATCHES`` Watch streams are open at once (services/grpc_setup.py).

A refused call gets UNAUTHENTICATED before any validation or allocation. A role refuses to
start without a token unless ``--insecure-no-auth`` is given, and then only on a loopback
address (``require_cluster_token``).

Secrets never travel in argv: the token comes from ``--cluster-token-file`` or the
``PDSERVE_CLUSTER_TOKEN`` environment variable (``pdserve up`` makes a random one per
deployment and hands it to its children through the environment).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import inspect
import ipaddress
import logging
import os
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from engine.settings import ENV

log = logging.getLogger(__name__)

CLUSTER_TOKEN_ENV = ENV.CLUSTER_TOKEN.name
API_KEY_ENV = ENV.API_KEY.name
AUTH_HEADER = "x-pdserve-auth"               # the caller's proof of the cluster token
AUTH_REPLY_HEADER = "x-pdserve-auth-reply"   # the server's, in its initial metadata
API_KEY_HEADER = "authorization"            # "Bearer <key>", as OpenAI-style clients send it
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
MIN_TOKEN_CHARS = 16
PROOF_WINDOW_S = 30.0          # members' clocks agree within this; a proof older (or newer) is refused
REPLAY_CACHE_MAX = 1 << 17     # nonces remembered (~15 MB at most); the oldest go first, see _Nonces
INSECURE_FLAG = "--insecure-no-auth"
INSECURE_PLANE_FLAG = "--insecure-internal-plane"
UNPROVEN_STATUS_WAIT_S = 0.5   # how long an unproven call's status is awaited before it is cancelled


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


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _text(value: str | bytes) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class CallProof:
    """One call's proof (its metadata) and the check of the server's reply to it."""

    metadata: tuple[tuple[str, str], ...] = ()
    expected_reply: str | None = None       # None: no token, nothing to check

    def verify(self, initial_metadata: Any) -> bool:
        """The server's initial metadata answers this call's nonce (always true without a token)."""
        if self.expected_reply is None:
            return True
        given = next((_text(v) for k, v in initial_metadata or () if k == AUTH_REPLY_HEADER), None)
        return given is not None and hmac.compare_digest(given.encode(), self.expected_reply.encode())


class ClusterKey:
    """The keys derived from the cluster token: one for callers' proofs, one for servers' replies."""

    def __init__(self, token: str) -> None:
        t = token.encode()
        self._caller = hmac.digest(t, b"pdserve v1 caller proof", "sha256")
        self._server = hmac.digest(t, b"pdserve v1 server proof", "sha256")

    def _mac(self, key: bytes, text: str) -> str:
        return _b64(hmac.digest(key, text.encode(), "sha256"))

    def prove(self, method: str, now_ms: int | None = None, nonce: str | None = None) -> CallProof:
        ms = int(time.time() * 1000) if now_ms is None else now_ms
        nonce = nonce or secrets.token_urlsafe(12)
        value = f"v1.{ms}.{nonce}.{self._mac(self._caller, f'{method}|{ms}|{nonce}')}"
        return CallProof(((AUTH_HEADER, value),), self.reply(method, nonce))

    def reply(self, method: str, nonce: str) -> str:
        return self._mac(self._server, f"reply|{method}|{nonce}")

    def check(self, method: str, value: str) -> str | None:
        """The nonce of a valid proof for method (None: malformed or wrong MAC; time and replay
        are the caller's checks)."""
        parts = value.split(".")
        if len(parts) != 4 or parts[0] != "v1" or not parts[1].isdigit() or len(parts[1]) > 16 \
                or not 8 <= len(parts[2]) <= 64:
            return None
        expected = self._mac(self._caller, f"{method}|{parts[1]}|{parts[2]}")
        return parts[2] if hmac.compare_digest(expected.encode(), parts[3].encode()) else None


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
    """What this process proves and demands on the internal plane."""

    cluster_token: str | None = None
    tls: TLSFiles | None = None
    key: ClusterKey | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", ClusterKey(self.cluster_token) if self.cluster_token else None)

    def call_proof(self, method: str | bytes) -> CallProof:
        """A fresh proof for one call of method (empty without a token)."""
        return self.key.prove(_text(method)) if self.key is not None else CallProof()

    # ---- servers ----------------------------------------------------------------------
    def server_interceptors(self, only: tuple[str, ...] | None = None) -> list[grpc.aio.ServerInterceptor]:
        """The cluster-token check for a server's methods (only: those under these prefixes)."""
        return [ClusterInterceptor(self.key, only=only)] if self.key is not None else []

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        cert, key, ca = self.tls.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=require_client_cert)

    # ---- clients ----------------------------------------------------------------------
    def channel(self, address: str, options: Sequence[tuple[str, Any]] = (), *,
                attach_token: bool = True) -> grpc.aio.Channel:
        """An asyncio channel to a member of the deployment, with TLS when configured, proving
        membership on every call and checking the server's proof before its response is read
        (attach_token=False: the caller passes ``call_proof(method).metadata`` and checks the
        reply itself, which saves the interceptors' per-call cost on a hot path)."""
        interceptors = proving_interceptors(self) if self.key is not None and attach_token else None
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
        """A blocking channel (tools, tests) proving membership on every call; a unary call's
        server must prove itself back."""
        channel = self.probe_channel(address, options)
        if self.key is not None:
            channel = grpc.intercept_channel(channel, _SyncProof(self))
        return channel

    # ---- the environment children inherit --------------------------------------------------
    def child_env(self) -> dict[str, str]:
        return {CLUSTER_TOKEN_ENV: self.cluster_token} if self.cluster_token else {}

    @classmethod
    def load(cls, token_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
             tls_ca: str | None = None) -> "Credentials":
        return cls(read_secret(token_file, CLUSTER_TOKEN_ENV, "cluster token"), TLSFiles.from_args(tls_cert, tls_key, tls_ca))


# ---- servers ----------------------------------------------------------------------------------

class ProofCheck:
    """The server side of a proof outside gRPC (a Ray actor's control method): a valid proof
    for the method, fresh, and used once."""

    def __init__(self, key: ClusterKey, window_s: float = PROOF_WINDOW_S) -> None:
        self.key = key
        self.nonces = _Nonces(int(window_s * 1000))

    def verify(self, method: str, value: object) -> bool:
        nonce = self.key.check(method, value) if isinstance(value, str) and value else None
        return nonce is not None and self.nonces.admit(int(value.split(".")[1]), nonce, int(time.time() * 1000))


class ClusterInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid, fresh, unused proof of the cluster token (health
    checks excepted), and proves itself in the initial metadata of the calls it lets through."""

    def __init__(self, key: ClusterKey, window_s: float = PROOF_WINDOW_S, replay_limit: int = REPLAY_CACHE_MAX,
                 only: tuple[str, ...] | None = None) -> None:
        """only: guard just the methods under these prefixes (the router's Membership service
        beside its public API); None: every method."""
        self.key = key
        self.nonces = _Nonces(int(window_s * 1000), replay_limit)
        self.only = only

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        method = details.method
        if method.startswith(OPEN_METHOD_PREFIXES) or (self.only is not None and not method.startswith(self.only)):
            return await continuation(details)
        given = next((_text(v) for k, v in details.invocation_metadata or () if k == AUTH_HEADER), None)
        nonce = self.key.check(method, given) if given is not None else None
        handler = await continuation(details)
        if nonce is None or not self.nonces.admit(int(given.split(".")[1]), nonce, int(time.time() * 1000)):
            return _refusing(handler, "missing, stale or wrong proof of the cluster token")
        return _proving(handler, ((AUTH_REPLY_HEADER, self.key.reply(method, nonce)),))


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the secret (health checks excepted): the router's
    API key, which clients send as a bearer header."""

    def __init__(self, header: str, secret: str, scheme: str = "", exempt: tuple[str, ...] = ()) -> None:
        """exempt: method prefixes another check guards (the router's Membership service: the cluster token)."""
        self.header = header
        self.expected = (f"{scheme} {secret}" if scheme else secret).encode()
        self.what = "API key" if header == API_KEY_HEADER else "secret"
        self.open = (*OPEN_METHOD_PREFIXES, *exempt)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        if details.method.startswith(self.open):
            return await continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == self.header), None)
        if given is not None and hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.expected):
            return await continuation(details)
        handler = await continuation(details)
        return _refusing(handler, f"missing or wrong {self.what}")


def api_key_interceptor(api_key: str, exempt: tuple[str, ...] = ()) -> SecretInterceptor:
    return SecretInterceptor(API_KEY_HEADER, api_key, scheme="Bearer", exempt=exempt)


MAKE_HANDLER = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
         (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
HANDLER_BEHAVIOR = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
             (True, True): "stream_stream"}


def _refusing(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler | None:
    """A handler of the same kind that answers UNAUTHENTICATED without touching the request."""
    if handler is None:
        return None

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kind = (handler.request_streaming, handler.response_streaming)
    return MAKE_HANDLER[kind](streaming if kind[1] else unary, request_deserializer=None, response_serializer=None)


def _proving(handler: grpc.RpcMethodHandler | None, metadata: tuple[tuple[str, str], ...]
             ) -> grpc.RpcMethodHandler | None:
    """The same handler, sending metadata (the server's proof) before anything else, and again
    in the trailers: grpcio's asyncio client can record a call that ends at once (an immediate
    refusal) with empty initial metadata, and the proof in the trailers still vouches for its status."""
    if handler is None:
        return None
    kind = (handler.request_streaming, handler.response_streaming)
    behavior = getattr(handler, HANDLER_BEHAVIOR[kind])

    if inspect.isasyncgenfunction(behavior):
        async def wrapped(request, context):
            context.set_trailing_metadata(metadata)
            await context.send_initial_metadata(metadata)
            async for item in behavior(request, context):
                yield item
    else:
        async def wrapped(request, context):
            context.set_trailing_metadata(metadata)
            await context.send_initial_metadata(metadata)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

    return MAKE_HANDLER[kind](wrapped, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


# ---- clients ----------------------------------------------------------------------------------

def unproven_error(method: str, initial_metadata: Any = None, code: grpc.StatusCode | None = None
                   ) -> grpc.aio.AioRpcError:
    claimed = f" (it claimed {code.name})" if code is not None else ""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, initial_metadata or grpc.aio.Metadata(),
                                grpc.aio.Metadata(),
                                details=f"{method}: the server did not prove it is a member of the deployment{claimed}")


# What a call ends with, unproven, that is no claim of its server: the transport's own failures,
# and a member's refusal of our proof (sent before it proves anything).
_UNPROVEN_PASS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                  grpc.StatusCode.UNAUTHENTICATED)


async def checked_call(call: Any, proof: CallProof, method: str) -> Any:
    """call, once its server's initial metadata proves membership; a call that failed before
    any (unreachable, refused) is returned as it is, its status saying why. Otherwise the call
    is cancelled and AioRpcError(UNAUTHENTICATED) raised: nothing it sent is read, nor any
    status it claimed (UNIMPLEMENTED, RESOURCE_EXHAUSTED...)."""
    metadata = await call.initial_metadata()
    if proof.verify(metadata):
        return call
    if not metadata and not call.done():
        # A trailers-only answer (a refusal, a transport failure) resolves the empty headers a
        # moment before the call's status is recorded: give the status that moment.
        with contextlib.suppress(asyncio.TimeoutError, grpc.RpcError):
            await asyncio.wait_for(asyncio.shield(call.code()), UNPROVEN_STATUS_WAIT_S)
    code = await call.code() if call.done() else None
    if code in _UNPROVEN_PASS or (code is not None and proof.verify(await call.trailing_metadata())):
        return call   # no claim of its server, or a status its server vouched for in the trailers
    call.cancel()
    raise unproven_error(method, metadata, code)


def _with_proof(details: grpc.aio.ClientCallDetails, proof: CallProof) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*proof.metadata)
    for key, value in details.metadata or ():
        metadata.add(key, value)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _Proving:
    """Adds make(method)'s metadata to each call; checks the server's reply when it expects one."""

    def __init__(self, make: Callable[[str], CallProof]) -> None:
        self.make = make

    async def intercept(self, continuation, details, request):
        method = _text(details.method)
        proof = self.make(method)
        call = await continuation(_with_proof(details, proof), request)
        return call if proof.expected_reply is None else await checked_call(call, proof, method)


# grpc.aio files an interceptor under the first of its four kinds it is: one class per kind.
class _UnaryUnary(_Proving, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _Proving.intercept


class _UnaryStream(_Proving, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _Proving.intercept


class _StreamUnary(_Proving, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _Proving.intercept


class _StreamStream(_Proving, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _Proving.intercept


def proving_interceptors(credentials: Credentials) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that prove membership on every call of an asyncio channel and check the
    server's proof before the call's response is read."""
    return _interceptors(credentials.call_proof)


def metadata_interceptors(extra: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add ``extra`` metadata (an API key) to every call of an asyncio channel."""
    proof = CallProof(extra)
    return _interceptors(lambda method: proof)


def _interceptors(make: Callable[[str], CallProof]) -> list[grpc.aio.ClientInterceptor]:
    return [_UnaryUnary(make), _UnaryStream(make), _StreamUnary(make), _StreamStream(make)]


class _Unproven(grpc.RpcError, grpc.Call):
    """What a blocking unary call raises when its server did not prove membership."""

    def __init__(self, method: str) -> None:
        self._details = f"{method}: the server did not prove it is a member of the deployment"

    def code(self):
        return grpc.StatusCode.UNAUTHENTICATED

    def details(self):
        return self._details

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


class _SyncProof(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

    def _details(self, details, proof: CallProof):
        return _SyncDetails(details.method, details.timeout, [*(details.metadata or ()), *proof.metadata],
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        proof = self.credentials.call_proof(details.method)
        outcome = continuation(self._details(details, proof), request)
        if outcome.code() == grpc.StatusCode.OK and not proof.verify(outcome.initial_metadata()):
            raise _Unproven(_text(details.method))
        return outcome

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details, self.credentials.call_proof(details.method)), request)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression
