from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVBlockHeader(_message.Message):
    __slots__ = ("request_id", "block_index", "block_hash", "num_tokens", "layer_start", "layer_end", "dtype", "shape", "nbytes", "checksum", "num_frames")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_index: int
    block_hash: int
    num_tokens: int
    layer_start: int
    layer_end: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    checksum: int
    num_frames: int
    def __init__(self, request_id: _Optional[str] = ..., block_index: _Optional[int] = ..., block_hash: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., num_frames: _Optional[int] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: KVBlockHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[KVBlockHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("blocks_received", "bytes_received", "rejected_block_indices", "error")
    BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    blocks_received: int
    bytes_received: int
    rejected_block_indices: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, blocks_received: _Optional[int] = ..., bytes_received: _Optional[int] = ..., rejected_block_indices: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...
