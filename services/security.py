"""Who may call what: the cluster token of the internal plane, the router's API key, mutual TLS.

Trust model (docs/architecture.md): clients reach only the router's public API, with an API
key when one is set. The internal plane (the worker services and KV transfer) accepts only
members of the deployment: every call carries the cluster token, compared in constant time
before the handler runs; with TLS configured every channel is mutually authenticated against
the deployment's CA as well. Health checks stay open (they reveal nothing and orchestrators
probe them). A refused call gets UNAUTHENTICATED before any validation or allocation.

Secrets never travel in argv: the token comes from ``--cluster-token-file`` or the
``PDSERVE_CLUSTER_TOKEN`` environment variable (``pdserve up`` makes a random one per
deployment and hands it to its children through the environment).
"""
from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

CLUSTER_TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
API_KEY_ENV = "PDSERVE_API_KEY"
CLUSTER_TOKEN_HEADER = "x-pdserve-cluster-token"
API_KEY_HEADER = "authorization"            # "Bearer <key>", as OpenAI-style clients send it
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
MIN_TOKEN_CHARS = 16


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
        value = os.environ.get(env, "").strip()
        if not value:
            return None
    if len(value) < MIN_TOKEN_CHARS:
        raise ValueError(f"{what} must have at least {MIN_TOKEN_CHARS} characters, got {len(value)}")
    return value


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

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((CLUSTER_TOKEN_HEADER, self.cluster_token),) if self.cluster_token else ()

    # ---- servers ----------------------------------------------------------------------
    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [SecretInterceptor(CLUSTER_TOKEN_HEADER, self.cluster_token)] if self.cluster_token else []

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        cert, key, ca = self.tls.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=require_client_cert)

    # ---- clients ----------------------------------------------------------------------
    def channel(self, address: str, options: Sequence[tuple[str, Any]] = (), *,
                attach_token: bool = True) -> grpc.aio.Channel:
        """An asyncio channel to a member of the deployment, with TLS when configured, carrying the
        token on every call (attach_token=False: the caller passes ``metadata`` itself, which
        saves the interceptors' per-call cost on a hot path)."""
        interceptors = metadata_interceptors(self.metadata) if self.metadata and attach_token else None
        if self.tls is not None:
            cert, key, ca = self.tls.read()
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)

    def sync_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel (launcher health probes, tools), carrying the token (and TLS)."""
        if self.tls is not None:
            cert, key, ca = self.tls.read()
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            channel = grpc.secure_channel(address, creds, options=list(options))
        else:
            channel = grpc.insecure_channel(address, options=list(options))
        if self.metadata:
            channel = grpc.intercept_channel(channel, _SyncMetadata(self.metadata))
        return channel

    # ---- the environment children inherit --------------------------------------------------
    def child_env(self) -> dict[str, str]:
        return {CLUSTER_TOKEN_ENV: self.cluster_token} if self.cluster_token else {}

    @classmethod
    def load(cls, token_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
             tls_ca: str | None = None) -> "Credentials":
        return cls(read_secret(token_file, CLUSTER_TOKEN_ENV, "cluster token"), TLSFiles.from_args(tls_cert, tls_key, tls_ca))


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the secret (health checks excepted)."""

    def __init__(self, header: str, secret: str, scheme: str = "") -> None:
        self.header = header
        self.expected = (f"{scheme} {secret}" if scheme else secret).encode()
        self.what = "API key" if header == API_KEY_HEADER else "cluster token"

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        if details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == self.header), None)
        if given is not None and hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.expected):
            return await continuation(details)
        handler = await continuation(details)
        return _refusing(handler, f"missing or wrong {self.what}")


def api_key_interceptor(api_key: str) -> SecretInterceptor:
    return SecretInterceptor(API_KEY_HEADER, api_key, scheme="Bearer")


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
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}[kind]
    return make(streaming if kind[1] else unary, request_deserializer=None, response_serializer=None)


# ---- client-side metadata ------------------------------------------------------------------

def _with_metadata(details: grpc.aio.ClientCallDetails, extra: tuple[tuple[str, str], ...]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*extra)
    for key, value in details.metadata or ():
        metadata.add(key, value)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, extra):
        self.extra = extra

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.extra), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, extra):
        self.extra = extra

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.extra), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, extra):
        self.extra = extra

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self.extra), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, extra):
        self.extra = extra

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self.extra), request_iterator)


def metadata_interceptors(extra: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add ``extra`` metadata to every call of an asyncio channel."""
    return [_UnaryUnary(extra), _UnaryStream(extra), _StreamUnary(extra), _StreamStream(extra)]


class _SyncMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self.extra = extra

    def _details(self, details):
        return _SyncDetails(details.method, details.timeout, [*(details.metadata or ()), *self.extra],
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression
