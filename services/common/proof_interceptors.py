"""The gRPC side of the proofs (services/common/proofs.py): the server interceptor that checks them
(and a call's first message against its proof) and proves the server back, the one that checks
a bearer secret, and the client interceptors that prove every call and check the server's reply."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import itertools
import time
from typing import Any, Callable, Protocol, Sequence

import grpc

from pdserve.engine.settings import ENV
from pdserve.services.common.proofs import (AUTH_REPLY_HEADER, CallProof, ClusterKey, PROOF_WINDOW_S,
    REPLAY_CACHE_MAX, ServerNames, _digest, _Nonces, _text)


class Prover(Protocol):
    """Who proves a caller's membership (services.common.security.Credentials): a proof per call,
    bound to the server dialed (target) and the call's first message."""

    def call_proof(self, method: str, target: str, message: bytes) -> CallProof: ...
    def admin_proof(self, method: str, target: str, message: bytes) -> CallProof: ...

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
FIRST_MESSAGE_WAIT_S = PROOF_WINDOW_S   # a request stream's first message (the proof's digest) comes within this
MEMBERSHIP_SERVICE = "/pdserve.v1.Membership/"
# What the admin token alone may call: every membership change. Members (the cluster token) join
# (a worker, itself) and list; the admin token lists too.
MEMBERSHIP_ADMIN_METHODS = frozenset(MEMBERSHIP_SERVICE + m for m in (
    "AddWorker", "DrainWorker", "ResumeWorker", "RemoveWorker", "SwitchRole"))
MEMBERSHIP_LIST_METHOD = MEMBERSHIP_SERVICE + "ListWorkers"
UNPROVEN_STATUS_WAIT_S = 0.5   # how long an unproven call's status is awaited before it is cancelled


# ---- servers ----------------------------------------------------------------------------------

class ClusterInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid, fresh, unused proof of the cluster token that names
    this server (health checks excepted; membership changes want the admin token's instead),
    checks the call's first message against the proof before the handler sees it, and proves
    itself in the initial metadata of the calls it lets through."""

    def __init__(self, key: ClusterKey | None, window_s: float = PROOF_WINDOW_S,
                 replay_limit: int = REPLAY_CACHE_MAX, only: tuple[str, ...] | None = None,
                 admin_key: ClusterKey | None = None, names: ServerNames | None = None) -> None:
        """only: guard just the methods under these prefixes (the router's Membership service
        beside its public API); None: every method. key None (no cluster token, loopback only):
        only membership changes are guarded, by admin_key. names: the server's (``serve_at``);
        until it is given, every guarded call is refused."""
        self.key, self.admin_key = key, admin_key
        self.nonces = _Nonces(int(window_s * 1000), replay_limit)
        self.only = only
        self.names = names

    def serve_at(self, host: str, port: int, advertised: Sequence[str] = ()) -> None:
        """The server's names: its bound host and port, and the addresses it is advertised at."""
        self.names = ServerNames.of(host, port, advertised)

    def _keys(self, method: str) -> tuple[ClusterKey, ...] | None:
        """The keys a proof for method may be of (None: the method is open)."""
        if method in MEMBERSHIP_ADMIN_METHODS:
            return (self.admin_key,) if self.admin_key is not None else ()
        if self.key is None:
            return None
        return (self.key, self.admin_key) if method == MEMBERSHIP_LIST_METHOD and self.admin_key else (self.key,)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        method = details.method
        if method.startswith(OPEN_METHOD_PREFIXES) or (self.only is not None and not method.startswith(self.only)):
            return await continuation(details)
        keys = self._keys(method)
        if keys is None:
            return await continuation(details)
        handler = await continuation(details)
        if not keys:
            return refusing(handler, f"{method.rsplit('/', 1)[-1]} changes membership: it needs the admin token, "
                                      f"and this router has none (--admin-token-file or ${ENV.ADMIN_TOKEN.name})")
        metadata = details.invocation_metadata or ()
        for key in keys:
            given = next((_text(v) for k, v in metadata if k == key.header), None)
            claim = key.check(method, given) if given else None
            if claim is None:
                continue
            if self.names is None or not self.names.accepts(claim.target):
                return refusing(handler, f"the proof names another server ({claim.target[:64]!r})")
            if not self.nonces.admit(claim.ms, claim.nonce, int(time.time() * 1000)):
                break
            return _proving(handler, ((AUTH_REPLY_HEADER, key.reply(method, claim.nonce)),), claim.digest)
        what = "the admin token" if keys[0] is self.admin_key else "the cluster token"
        return refusing(handler, f"missing, stale or wrong proof of {what}")


MAKE_HANDLER = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
         (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
HANDLER_BEHAVIOR = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
             (True, True): "stream_stream"}


def refusing(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler | None:
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


_REFUSED = object()   # what a first message that does not match its proof deserializes to
MESSAGE_REFUSED = "the call's first message is not the one its proof was made for"


class _FirstMessage:
    """A call's request deserializer that checks the first message's bytes against the proof's
    digest (once: later messages are only parsed). A mismatch deserializes to _REFUSED, unparsed."""

    __slots__ = ("digest", "parse", "seen")

    def __init__(self, digest: str, parse: Callable[[bytes], Any] | None) -> None:
        self.digest, self.parse, self.seen = digest.encode(), parse, False

    def __call__(self, raw: bytes) -> Any:
        if not self.seen:
            self.seen = True
            if not hmac.compare_digest(_digest(raw).encode(), self.digest):
                return _REFUSED
        return self.parse(raw) if self.parse is not None else raw


async def _chain(first: Any, rest: Any):
    yield first
    async for item in rest:
        yield item


def _proving(handler: grpc.RpcMethodHandler | None, metadata: tuple[tuple[str, str], ...], digest: str
             ) -> grpc.RpcMethodHandler | None:
    """The same handler, run only once the call's first message matches digest, sending metadata
    (the server's proof) before anything else, and again in the trailers: grpcio's asyncio
    client can record a call that ends at once (an immediate refusal) with empty initial
    metadata, and the proof in the trailers still vouches for its status. A request stream's
    first message is awaited (FIRST_MESSAGE_WAIT_S at most) after the proof went out: a KV sender
    checks that proof before it sends anything."""
    if handler is None:
        return None
    kind = (handler.request_streaming, handler.response_streaming)
    behavior = getattr(handler, HANDLER_BEHAVIOR[kind])

    async def admitted(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not kind[0] and request is _REFUSED:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE_REFUSED)
        context.set_trailing_metadata(metadata)
        await context.send_initial_metadata(metadata)
        if not kind[0]:
            return request
        rest = request.__aiter__()
        try:
            first = await asyncio.wait_for(rest.__anext__(), FIRST_MESSAGE_WAIT_S)
        except (StopAsyncIteration, asyncio.TimeoutError):
            first = _REFUSED
        if first is _REFUSED:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE_REFUSED)
        return _chain(first, rest)

    if inspect.isasyncgenfunction(behavior):
        async def wrapped(request, context):
            request = await admitted(request, context)
            async for item in behavior(request, context):
                yield item
    else:
        async def wrapped(request, context):
            request = await admitted(request, context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

    return MAKE_HANDLER[kind](wrapped, request_deserializer=_FirstMessage(digest, handler.request_deserializer),
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


def message_bytes(message: Any) -> bytes | bytearray | memoryview:
    """A request message as its serializer sends it: raw bytes as they are, a protobuf serialized."""
    return message if isinstance(message, (bytes, bytearray, memoryview)) else message.SerializeToString()


def _first_of(requests: Any) -> tuple[Any, Any]:
    """(the first message, the same stream) of a request stream given as an iterable. An async
    stream, or one written with ``call.write`` (grpc.aio hands the interceptor a generator fed by
    the writes), cannot be read ahead here: its proof names the empty message, so the server
    refuses it unless that is its first; make such a call's proof yourself (attach_token=False,
    ``Credentials.call_proof(method, target, first message)``), as the KV sender does."""
    if requests is None or hasattr(requests, "__aiter__") or not hasattr(requests, "__iter__"):
        return b"", requests
    it = iter(requests)
    for first in it:
        return first, itertools.chain((first,), it)
    raise ValueError("a request stream on a proving channel needs a first message (its proof names it)")


class _Proving:
    """Adds make(method, first message)'s metadata to each call; checks the server's reply when
    it expects one. with_message=False: make ignores the message (an API key), none is serialized."""

    def __init__(self, make: Callable[[str, Any], CallProof], with_message: bool = True) -> None:
        self.make, self.with_message = make, with_message

    async def _call(self, continuation, details, request, first: Any):
        method = _text(details.method)
        proof = self.make(method, message_bytes(first) if self.with_message else b"")
        call = await continuation(_with_proof(details, proof), request)
        return call if not proof.expected else await checked_call(call, proof, method)

    async def intercept(self, continuation, details, request):
        return await self._call(continuation, details, request, request)

    async def intercept_streaming(self, continuation, details, requests):
        if not self.with_message:
            return await self._call(continuation, details, requests, None)
        first, requests = _first_of(requests)
        return await self._call(continuation, details, requests, first)


# grpc.aio files an interceptor under the first of its four kinds it is: one class per kind.
class _UnaryUnary(_Proving, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _Proving.intercept


class _UnaryStream(_Proving, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _Proving.intercept


class _StreamUnary(_Proving, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _Proving.intercept_streaming


class _StreamStream(_Proving, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _Proving.intercept_streaming


def proving_interceptors(credentials: Prover, target: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that prove membership on every call of an asyncio channel to target (the
    HOST:PORT it dials), each proof bound to its call's first message, and check the server's
    proof before the call's response is read."""
    return _interceptors(lambda method, message: credentials.call_proof(method, target, message))


def metadata_interceptors(extra: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add ``extra`` metadata (an API key) to every call of an asyncio channel."""
    proof = CallProof(extra)
    return _interceptors(lambda method, message: proof, with_message=False)


def _interceptors(make: Callable[[str, Any], CallProof], with_message: bool = True
                  ) -> list[grpc.aio.ClientInterceptor]:
    return [cls(make, with_message) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


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


class SyncProof(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """A blocking channel's proofs: of the cluster token, and of the admin token when held (the
    server answers the one its method wants), each naming target and the call's message."""

    def __init__(self, credentials: Prover, target: str) -> None:
        self.credentials, self.target = credentials, target

    def _proof(self, details, request) -> CallProof:
        method, message = _text(details.method), message_bytes(request)
        return self.credentials.call_proof(method, self.target, message) \
            + self.credentials.admin_proof(method, self.target, message)

    def _details(self, details, proof: CallProof):
        return _SyncDetails(details.method, details.timeout, [*(details.metadata or ()), *proof.metadata],
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        proof = self._proof(details, request)
        outcome = continuation(self._details(details, proof), request)
        if outcome.code() == grpc.StatusCode.OK and not proof.verify(outcome.initial_metadata()):
            raise _Unproven(_text(details.method))
        return outcome

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details, self._proof(details, request)), request)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression
