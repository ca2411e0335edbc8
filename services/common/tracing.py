"""Request traces across processes (OpenTelemetry), exported over OTLP/gRPC when a process is
started with ``--otlp-endpoint HOST:PORT``; without it no tracer exists and every hook here
returns at its first test (``_tracer is None``): tracing off costs nothing measurable.

One disaggregated request is one trace:

- router (services/router/generator.py): ``pdserve.request``, the root, from arrival to the last
  token (request id, prompt and output tokens, priority, finish reason, migrations; an event per
  migration with its cause), with children ``pdserve.admission`` (the wait for decode capacity:
  queue and reservation) and ``pdserve.kv_transfer`` (from the first token to the decode worker's
  acknowledgement of the last block: bytes, wire bytes, codec, exposed ms);
- workers: one span per internal RPC they serve (``pdserve.worker/Prefill``, ``.../Decode``,
  ``.../Reserve``, ``.../Generate``), children of the router's span through the W3C
  ``traceparent`` the router sends in each call's metadata; each message a stream sends is an
  event (a prefill's progress, first token and KV delivery; each decode step's tokens), so the
  decode steps by batch are on the decode worker's span.

Spans are batched and exported in the background (the SDK's BatchSpanProcessor); a process flushes
them when it stops (``shutdown``). The SDK and the OTLP exporter are the optional extra
``pdserve[tracing]``.

Spans carry request ids and timings across the network, so the exporter's channel follows the
internal plane's rule (``exporter_security``): a loopback collector gets plaintext; any other
gets TLS, with the deployment's CA and certificate when mutual TLS is configured (else an
``https://`` endpoint, with the system's roots); a plaintext collector off loopback is refused at
start unless ``--otlp-insecure``. The client's ``user`` is never exported: a span gets
``user_hash`` instead, an HMAC of it under a key derived from the cluster token (stable across
the deployment's processes and restarts; without a token, a key of this process).
"""
from __future__ import annotations

import hmac
import inspect
import logging
import secrets
from typing import Any, Callable

import grpc

from pdserve.services.common.security import Credentials
from pdserve.services.common.proof_interceptors import HANDLER_BEHAVIOR, MAKE_HANDLER
from pdserve.services.common.proofs import host_of, is_loopback

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
OTLP_INSECURE_FLAG = "--otlp-insecure"
HIDDEN = {"user": "user_hash"}   # attributes never exported as given: name -> the name of their keyed hash
_tracer: Any = None          # the process's tracer once configure() set one; None: tracing off
_provider: Any = None
_hash_key: bytes = secrets.token_bytes(32)   # replaced by the cluster token's derived key in configure()


def exporter_security(endpoint: str, credentials: Credentials | None = None, insecure: bool = False
                      ) -> tuple[bool, grpc.ChannelCredentials | None]:
    """(plaintext?, TLS credentials) of the exporter's channel to endpoint (see the module
    docstring); ValueError naming the flags for a plaintext collector off loopback."""
    scheme, _, rest = endpoint.rpartition("://")
    host = host_of(rest.split("/", 1)[0])
    tls = credentials.tls if credentials is not None else None
    if insecure or (is_loopback(host) and scheme != "https"):
        if not is_loopback(host):
            log.warning("%s: spans go to the OTLP collector at %s in clear (request ids, timings)",
                        OTLP_INSECURE_FLAG, endpoint)
        return True, None
    if tls is not None:
        cert, key, ca = tls.read()
        return False, grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    if scheme == "https":
        return False, grpc.ssl_channel_credentials()
    raise ValueError(f"--otlp-endpoint {endpoint[:80]} is not loopback and this process has no TLS: its spans "
                     f"would travel in clear. Pass --tls-cert, --tls-key and --tls-ca (the collector's certificate "
                     f"signed by the deployment CA), an https:// endpoint, or {OTLP_INSECURE_FLAG} on a network "
                     f"you trust")


def hash_key(credentials: Credentials | None) -> bytes:
    """The key of hidden attributes' hashes: derived from the cluster token, else this process's own."""
    if credentials is not None and credentials.cluster_token:
        return hmac.digest(credentials.cluster_token.encode(), b"pdserve v1 trace attribute hash", "sha256")
    return secrets.token_bytes(32)


def _attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """attributes without the Nones, each hidden one as its keyed hash (16 bytes, hex)."""
    out = {}
    for k, v in attributes.items():
        if v is None:
            continue
        if k in HIDDEN:
            k, v = HIDDEN[k], hmac.digest(_hash_key, str(v).encode(), "sha256")[:16].hex()
        out[k] = v
    return out


def configure(service: str, endpoint: str | None, instance: str = "", credentials: Credentials | None = None,
              insecure: bool = False) -> bool:
    """Trace this process's work to the OTLP collector at endpoint (HOST:PORT, or http(s)://...):
    TLS as ``exporter_security`` says (insecure: --otlp-insecure); nothing without an endpoint.
    True when tracing is on."""
    global _tracer, _provider, _hash_key
    if not endpoint:
        return False
    plaintext, channel_credentials = exporter_security(endpoint, credentials, insecure)
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ValueError("--otlp-endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                         "pip install 'pdserve[tracing]'") from None
    resource = Resource.create({"service.name": service, "service.instance.id": instance or service})
    _provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=plaintext, credentials=channel_credentials)
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    _hash_key = hash_key(credentials)
    _tracer = _provider.get_tracer("pdserve")
    log.info("tracing to the OTLP collector at %s as %s (%s)", endpoint, service, "plaintext" if plaintext else "TLS")
    return True


def shutdown() -> None:
    """Export what is still buffered, then stop tracing."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def _context(parent: Any = None, metadata: Any = None):
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    if parent is not None:
        return trace.set_span_in_context(parent)
    if metadata:
        carrier = {k: v for k, v in metadata if k == TRACEPARENT}
        if carrier:
            return TraceContextTextMapPropagator().extract(carrier)
    return None


def start(name: str, parent: Any = None, metadata: Any = None, **attributes: Any) -> Any:
    """A new span (None when tracing is off): a child of parent (a span), or of the caller whose
    gRPC metadata carries a traceparent, else a root."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=_context(parent, metadata), attributes=_attributes(attributes))


def event(span: Any, name: str, **attributes: Any) -> None:
    if span is not None:
        span.add_event(name, _attributes(attributes))


def end(span: Any, error: str | None = None, **attributes: Any) -> None:
    """End span, with attributes; error (a status code's name and why) marks it failed."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode
    if attributes:
        span.set_attributes(_attributes(attributes))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def metadata(span: Any) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that makes the callee's span a child of span (empty when off)."""
    if span is None:
        return ()
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=_context(span))
    return tuple(carrier.items())


def traceparent(span: Any) -> str:
    """The W3C traceparent that makes the callee's span a child of span, for a request carried
    in a message rather than a call of its own ("" when off)."""
    return dict(metadata(span)).get(TRACEPARENT, "")


def start_from_traceparent(name: str, value: str, **attributes: Any) -> Any:
    """A new span, a child of the caller's span that value (traceparent()) names, else a root."""
    return start(name, metadata=((TRACEPARENT, value),) if value else None, **attributes)


# ---- servers ------------------------------------------------------------------------------------

# Methods that carry many requests and trace each one themselves (start_from_traceparent).
SELF_TRACED = frozenset({"/pdserve.v1.DecodeWorker/DecodeMany"})

WORKER_SERVICES = ("/pdserve.v1.PrefillWorker/", "/pdserve.v1.DecodeWorker/", "/pdserve.v1.ColocatedWorker/")


def server_interceptors(prefixes: tuple[str, ...] = WORKER_SERVICES) -> list[grpc.aio.ServerInterceptor]:
    """A span per RPC of the services under prefixes (a worker's request work; not its status
    streams), each message a stream sends an event; none when tracing is off."""
    return [_TracingInterceptor(prefixes)] if _tracer is not None else []


def _message_event(span: Any, message: Any) -> None:
    """One streamed message as an event: its oneof's name (or its type), and its token count."""
    which = message.WhichOneof("event") if "event" in type(message).DESCRIPTOR.oneofs_by_name else None
    tokens = getattr(message, "token_ids", None)
    event(span, which or type(message).__name__, tokens=len(tokens) if tokens is not None else None)


class _TracingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefixes) or details.method in SELF_TRACED:
            return handler
        return _traced(handler, details.method.rsplit("/", 1)[-1], details.invocation_metadata)


def _traced(handler: grpc.RpcMethodHandler, method: str, invocation_metadata: Any) -> grpc.RpcMethodHandler:
    kind = (handler.request_streaming, handler.response_streaming)
    behavior = getattr(handler, HANDLER_BEHAVIOR[kind])
    name = f"pdserve.worker/{method}"

    def open_span(request: Any):
        rid = getattr(request, "request_id", None) if not kind[0] else None
        return start(name, metadata=invocation_metadata, request_id=rid or None)

    if inspect.isasyncgenfunction(behavior):
        async def wrapped(request, context):
            span, error = open_span(request), None
            try:
                async for item in behavior(request, context):
                    _message_event(span, item)
                    yield item
            except BaseException as exc:
                error = _error(context, exc)
                raise
            finally:
                end(span, error or _aborted(context))
    else:
        async def wrapped(request, context):
            span, error = open_span(request), None
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            except BaseException as exc:
                error = _error(context, exc)
                raise
            finally:
                end(span, error or _aborted(context))

    return MAKE_HANDLER[kind](wrapped, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


def _aborted(context: Any) -> str | None:
    code = context.code() if hasattr(context, "code") else None
    if code is None or code == grpc.StatusCode.OK or code == 0:
        return None
    name = code.name if hasattr(code, "name") else str(code)
    return f"{name}: {context.details() if hasattr(context, 'details') else ''}"


def _error(context: Any, exc: BaseException) -> str:
    return _aborted(context) or f"{type(exc).__name__}: {exc}"
