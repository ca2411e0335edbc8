"""KV-cache block transport between prefill and decode workers: byte pipes under the engine's
KV connector (engine/kv/connector.py), over gRPC streams (grpc_transport) or Ray's object
store (ray_transport).

The names below load on first use, so a process that needs only ``shared_memory`` (the
supervisor of `pdserve up` removing a dead child's segments) does not import torch."""
from __future__ import annotations

from pdserve.engine.lazy_exports import lazy_getattr

_WHERE = {
    **dict.fromkeys(("DEFAULT_FRAME_BYTES", "SUPPORTED_DTYPES", "KVBlock", "KVSender", "KVSink", "KVStream",
                     "KVTransferError", "SendResult", "block_meta", "dtype_name"), "pdserve.services.kv_transfer.base"),
    "GrpcKVSender": "pdserve.services.kv_transfer.grpc_transport",
    **dict.fromkeys(("KVTransferServicer", "register_kv_servicer"), "pdserve.services.kv_transfer.grpc_receiver"),
}

__all__ = sorted(_WHERE)


__getattr__ = lazy_getattr(__name__, _WHERE, globals())
