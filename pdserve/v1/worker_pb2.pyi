from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BOTH: WorkerRole

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("role", "worker_id", "model_name", "kv_address", "num_total_blocks", "num_free_blocks", "num_running", "num_waiting", "num_reserved", "num_queued_prompt_tokens", "block_size", "num_layers", "num_kv_heads", "head_dim", "kv_dtype", "max_model_len", "draining", "num_sending", "step_base_ms", "step_ms_per_token", "max_num_batched_tokens", "decode_ms_per_seq", "kv_tier_load_ms_per_block")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_SENDING_FIELD_NUMBER: _ClassVar[int]
    STEP_BASE_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_PER_SEQ_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOAD_MS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    worker_id: str
    model_name: str
    kv_address: str
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_reserved: int
    num_queued_prompt_tokens: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    max_model_len: int
    draining: bool
    num_sending: int
    step_base_ms: float
    step_ms_per_token: float
    max_num_batched_tokens: int
    decode_ms_per_seq: float
    kv_tier_load_ms_per_block: float
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., worker_id: _Optional[str] = ..., model_name: _Optional[str] = ..., kv_address: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_reserved: _Optional[int] = ..., num_queued_prompt_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., draining: _Optional[bool] = ..., num_sending: _Optional[int] = ..., step_base_ms: _Optional[float] = ..., step_ms_per_token: _Optional[float] = ..., max_num_batched_tokens: _Optional[int] = ..., decode_ms_per_seq: _Optional[float] = ..., kv_tier_load_ms_per_block: _Optional[float] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("reset", "stored", "removed", "tiered")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TIERED_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    tiered: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reset: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., tiered: _Optional[_Iterable[int]] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("address", "transfer_token", "needed_block_indices", "data_address")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEEDED_BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    transfer_token: bytes
    needed_block_indices: _containers.RepeatedScalarFieldContainer[int]
    data_address: str
    def __init__(self, address: _Optional[str] = ..., transfer_token: _Optional[bytes] = ..., needed_block_indices: _Optional[_Iterable[int]] = ..., data_address: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "params", "target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    target: KVTarget
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "finish_reason", "num_cached_tokens", "queue_ms", "prefill_ms", "logprob", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    finish_reason: str
    num_cached_tokens: int
    queue_ms: float
    prefill_ms: float
    logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class KVDelivered(_message.Message):
    __slots__ = ("blocks", "bytes", "exposed_ms", "exposed_blocks", "wire_bytes", "codec", "streams")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_MS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    exposed_ms: float
    exposed_blocks: int
    wire_bytes: int
    codec: str
    streams: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., exposed_ms: _Optional[float] = ..., exposed_blocks: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., codec: _Optional[str] = ..., streams: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("computed_tokens",)
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    computed_tokens: int
    def __init__(self, computed_tokens: _Optional[int] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "kv_delivered", "progress")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    kv_delivered: KVDelivered
    progress: Progress
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., kv_delivered: _Optional[_Union[KVDelivered, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "params", "lease_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    lease_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("needed_block_indices", "held_block_hashes", "num_blocks", "transfer_token", "lease_ms", "data_address")
    NEEDED_BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    needed_block_indices: _containers.RepeatedScalarFieldContainer[int]
    held_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: int
    transfer_token: bytes
    lease_ms: int
    data_address: str
    def __init__(self, needed_block_indices: _Optional[_Iterable[int]] = ..., held_block_hashes: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[int] = ..., transfer_token: _Optional[bytes] = ..., lease_ms: _Optional[int] = ..., data_address: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "kv_wait_ms", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    kv_wait_ms: int
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., kv_wait_ms: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class FailTransferRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "finished", "kv_wait_ms", "first_decode_step_ms", "logprobs", "spec_decode", "request_id", "error_code", "error_message")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    finished: bool
    kv_wait_ms: float
    first_decode_step_ms: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    spec_decode: _common_pb2.SpecDecodeCounts
    request_id: str
    error_code: int
    error_message: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., finished: _Optional[bool] = ..., kv_wait_ms: _Optional[float] = ..., first_decode_step_ms: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., spec_decode: _Optional[_Union[_common_pb2.SpecDecodeCounts, _Mapping]] = ..., request_id: _Optional[str] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class DecodeControl(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: DecodeRequest
    cancel: str
    def __init__(self, start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class DecodeEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ...) -> None: ...

class GenerateLocalRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateLocalEvent(_message.Message):
    __slots__ = ("first_token", "decode", "progress")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    decode: DecodeEvent
    progress: Progress
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., decode: _Optional[_Union[DecodeEvent, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...
