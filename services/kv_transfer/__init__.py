"""KV-cache block transport between prefill and decode workers: byte pipes under the engine's
KV connector (engine/kv_connector.py), over gRPC streams (grpc_transport) or Ray's object
store (ray_transport).

The names below load on first use, so a process that needs only ``shared_memory`` (the
supervisor of `pdserve up` removing a dead child's segments) does not import torch."""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    **dict.fromkeys(("DEFAULT_FRAME_BYTES", "SUPPORTED_DTYPES", "KVBlock", "KVSender", "KVSink", "KVStream",
                     "KVTransferError", "SendResult", "block_meta", "dtype_name"), "services.kv_transfer.base"),
    **dict.fromkeys(("GrpcKVSender", "KVTransferServicer", "register_kv_servicer"),
                    "services.kv_transfer.grpc_transport"),
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
