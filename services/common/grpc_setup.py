"""gRPC bootstrap shared by every process: servers with health, reflection, auth and limits;
channels with keepalive and fast reconnects."""
from __future__ import annotations

import asyncio
import signal
import socket
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.services.common.ports import reuse_port
from pdserve.services.common.proof_interceptors import ClusterInterceptor

# A message bigger than this is refused by gRPC before it is buffered (KV frames are 4 MiB by
# default; the largest frame accepted is MAX_FRAME_BYTES, see kv_transfer.base).
MAX_MESSAGE_BYTES = 16 << 20
MAX_PING_STRIKES = 2
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.lookahead_bytes", 8 << 20),                # a stream may send this much before a window update
    ("grpc.http2.max_frame_size", 16 << 20 - 1),
    ("grpc.keepalive_permit_without_calls", 1),
    # Our channels ping every 2 s (CHANNEL_OPTIONS); a peer pinging more often than once a second
    # gets a strike, and after MAX_PING_STRIKES a GOAWAY (ENHANCE_YOUR_CALM): no ping flood.
    # (gRPC core's name for the minimum interval between received pings; with a misspelt key the
    # 5-minute default applies and every keepalive ping of a silent stream is a strike.)
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
]
MAX_HEALTH_WATCHES = 64    # open grpc.health.v1 Watch streams per server (Check is unlimited)
# Internal channels: a peer that stops answering (dead, frozen, partitioned) is noticed within
# keepalive_time + keepalive_timeout, and a restarted one is reconnected within a second.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.lookahead_bytes", 8 << 20),
    ("grpc.http2.max_frame_size", 16 << 20 - 1),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class BoundedHealthServicer(health.aio.HealthServicer):
    """grpc.health.v1, open to anyone (no secret), with at most max_watches Watch streams at once:
    more get RESOURCE_EXHAUSTED instead of a stream held open forever."""

    def __init__(self, max_watches: int = MAX_HEALTH_WATCHES) -> None:
        super().__init__()
        self.max_watches = max_watches
        self.watches = 0

    async def Watch(self, request, context) -> None:
        if self.watches >= self.max_watches:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"at most {self.max_watches} health Watch streams at once; use Check")
        self.watches += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watches -= 1


class Malformed:
    """What a request deserializes to when its bytes are not a valid message (bad protobuf,
    invalid UTF-8 in a string field): the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = f"malformed request: {type(error).__name__}: {error}"


def _safe_parser(cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(data: bytes) -> Message | Malformed:
        try:
            return cls.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, UnicodeDecodeError...
            return Malformed(exc)
    return parse


def _guard(behavior: Callable, streaming_response: bool) -> Callable:
    if streaming_response:
        async def stream(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            async for item in behavior(request, context):
                yield item
        return stream

    async def unary(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await behavior(request, context)
    return unary


def _guard_both_streams(behavior: Callable) -> Callable:
    async def stream(requests, context):
        async def checked():
            async for request in requests:
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
                yield request
        async for item in behavior(checked(), context):
            yield item
    return stream


def service_registration(service: ServiceDescriptor, servicer: object) -> tuple[Callable, object, str]:
    """Register servicer's methods for a proto service (methods that stream only their requests
    excepted: they handle their own frames). Malformed requests get INVALID_ARGUMENT, and each
    response is serialized as the type the proto declares (a wrong type fails loudly, in tests)."""
    def add(servicer: object, server: grpc.aio.Server) -> None:
        handlers = {}
        for method in service.methods:
            req, resp = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
            behavior = getattr(servicer, method.name)
            if method.client_streaming and not method.server_streaming:
                raise ValueError(f"{service.full_name}.{method.name}: request streams register themselves")
            if method.client_streaming:
                make, guarded = grpc.stream_stream_rpc_method_handler, _guard_both_streams(behavior)
            elif method.server_streaming:
                make, guarded = grpc.unary_stream_rpc_method_handler, _guard(behavior, True)
            else:
                make, guarded = grpc.unary_unary_rpc_method_handler, _guard(behavior, False)
            handlers[method.name] = make(guarded, request_deserializer=_safe_parser(req),
                                         response_serializer=resp.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
        server.add_registered_method_handlers(service.full_name, handlers)
    return add, servicer, service.full_name


@dataclass(eq=False)
class Server:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    services: list[str]

    async def set_serving(self, serving: bool) -> None:
        """Health of every service (and the server as a whole): SERVING or NOT_SERVING."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.services]:
            await self.health.set(name, status)


def check_port_free(host: str, port: int) -> None:
    """Raise OSError naming the address when something already listens on it (before starting
    anything: gRPC alone would report the failure late, and never for a port 0). A port our
    supervisor reserved for us (services/common/ports.py) is ours: nothing to check."""
    if port == 0 or reuse_port(port):
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As gRPC binds: connections in TIME_WAIT (a restarted router's) do not count, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, f"{host}:{port} is already in use ({exc.strerror})") from None


async def start_server(registrations: Iterable[tuple[Callable, object, str]], host: str, port: int, *,
                       interceptors: list[grpc.aio.ServerInterceptor] | None = None,
                       credentials: grpc.ServerCredentials | None = None,
                       serving: bool = True, advertised: Iterable[str] = ()) -> Server:
    """registrations: (add_XServicer_to_server, servicer, full service name). Returns the started
    server (health SERVING unless serving=False) and its bound port. The proof checks among
    interceptors learn the server's names: host and the bound port, and the advertised
    HOST:PORTs it is dialed at besides (a proof naming another server is refused)."""
    # SO_REUSEPORT only on a port the supervisor reserved for us: elsewhere a busy port fails.
    server = grpc.aio.server(options=[*SERVER_OPTIONS, ("grpc.so_reuseport", int(reuse_port(port)))],
                             interceptors=interceptors or ())
    names = []
    for add, servicer, name in registrations:
        add(servicer, server)
        names.append(name)
    health_servicer = BoundedHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}")
    for interceptor in interceptors or ():
        if isinstance(interceptor, ClusterInterceptor):
            interceptor.serve_at(host, bound, tuple(advertised))
    await server.start()
    result = Server(server, bound, health_servicer, names)
    await result.set_serving(serving)
    return result


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set stop (where the loop supports signal handlers)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass


def options(extra: Iterable[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """CHANNEL_OPTIONS with extra ones taking precedence."""
    extra = list(extra)
    keys = {k for k, _ in extra}
    return [*(o for o in CHANNEL_OPTIONS if o[0] not in keys), *extra]
