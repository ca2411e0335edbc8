from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVStreamOpen(_message.Message):
    __slots__ = ("request_id", "transfer_token", "mac", "mac_algorithm")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    MAC_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_token: bytes
    mac: bytes
    mac_algorithm: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_token: _Optional[bytes] = ..., mac: _Optional[bytes] = ..., mac_algorithm: _Optional[str] = ...) -> None: ...

class KVBlockHeader(_message.Message):
    __slots__ = ("request_id", "block_index", "block_hash", "num_tokens", "layer_start", "layer_end", "dtype", "shape", "nbytes", "checksum", "head_start", "head_end", "codec", "raw_nbytes")
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
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
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
    head_start: int
    head_end: int
    codec: str
    raw_nbytes: int
    def __init__(self, request_id: _Optional[str] = ..., block_index: _Optional[int] = ..., block_hash: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ..., codec: _Optional[str] = ..., raw_nbytes: _Optional[int] = ...) -> None: ...

class KVSharedMemory(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("open", "headers", "payload", "shm", "mac")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    open: KVStreamOpen
    headers: _containers.RepeatedCompositeFieldContainer[KVBlockHeader]
    payload: bytes
    shm: KVSharedMemory
    mac: bytes
    def __init__(self, open: _Optional[_Union[KVStreamOpen, _Mapping]] = ..., headers: _Optional[_Iterable[_Union[KVBlockHeader, _Mapping]]] = ..., payload: _Optional[bytes] = ..., shm: _Optional[_Union[KVSharedMemory, _Mapping]] = ..., mac: _Optional[bytes] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("blocks_received", "bytes_received", "error_code", "error")
    BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    blocks_received: int
    bytes_received: int
    error_code: str
    error: str
    def __init__(self, blocks_received: _Optional[int] = ..., bytes_received: _Optional[int] = ..., error_code: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
