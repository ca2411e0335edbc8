"""KV-cache block transport between prefill and decode workers.

``base`` holds the transport-neutral pieces (block/header types, checksum and
header verification, ``KVSink``/``KVSender`` interfaces); ``grpc_transport``
implements them over ``pdserve.v1.KVTransfer``.
"""

from services.kv_transfer.base import (
    DEFAULT_MAX_BLOCK_BYTES,
    SUPPORTED_DTYPES,
    BlockHeader,
    BlockReceiver,
    KVBlock,
    KVIntegrityError,
    KVSender,
    KVSink,
    KVTransferError,
    KVTransportError,
    ReceiverStats,
    SenderStats,
    SendResult,
    block_checksum,
    check_header,
    decode_tensor,
    dtype_from_name,
    dtype_name,
    encode_block,
    verify_payload,
)
from services.kv_transfer.grpc_transport import (
    DEFAULT_MAX_FRAME_BYTES,
    GrpcKVSender,
    KVTransferServicer,
    add_kv_transfer_servicer,
    kv_grpc_options,
    register_kv_servicer,
)

__all__ = [
    "DEFAULT_MAX_BLOCK_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
    "SUPPORTED_DTYPES",
    "BlockHeader",
    "BlockReceiver",
    "GrpcKVSender",
    "KVBlock",
    "KVIntegrityError",
    "KVSender",
    "KVSink",
    "KVTransferError",
    "KVTransferServicer",
    "KVTransportError",
    "ReceiverStats",
    "SendResult",
    "SenderStats",
    "add_kv_transfer_servicer",
    "block_checksum",
    "check_header",
    "decode_tensor",
    "dtype_from_name",
    "dtype_name",
    "encode_block",
    "kv_grpc_options",
    "register_kv_servicer",
    "verify_payload",
]
