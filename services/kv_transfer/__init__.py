"""KV-cache block transport between prefill and decode workers: byte pipes under the engine's
KV connector (engine/kv_connector.py), over gRPC streams (grpc_transport) or Ray's object
store (ray_transport)."""

from services.kv_transfer.base import (
    DEFAULT_FRAME_BYTES,
    SUPPORTED_DTYPES,
    KVBlock,
    KVSender,
    KVSink,
    KVStream,
    KVTransferError,
    SendResult,
    block_meta,
    dtype_name,
)
from services.kv_transfer.grpc_transport import GrpcKVSender, KVTransferServicer, register_kv_servicer

__all__ = [
    "DEFAULT_FRAME_BYTES",
    "SUPPORTED_DTYPES",
    "GrpcKVSender",
    "KVBlock",
    "KVSender",
    "KVSink",
    "KVStream",
    "KVTransferError",
    "KVTransferServicer",
    "SendResult",
    "block_meta",
    "dtype_name",
    "register_kv_servicer",
]
