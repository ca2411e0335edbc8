from pdserve.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_JOINING: _ClassVar[MemberState]
    MEMBER_STATE_SERVING: _ClassVar[MemberState]
    MEMBER_STATE_DOWN: _ClassVar[MemberState]
    MEMBER_STATE_DRAINING: _ClassVar[MemberState]
    MEMBER_STATE_DRAINED: _ClassVar[MemberState]
    MEMBER_STATE_REMOVED: _ClassVar[MemberState]
    MEMBER_STATE_SWITCHING: _ClassVar[MemberState]
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_JOINING: MemberState
MEMBER_STATE_SERVING: MemberState
MEMBER_STATE_DOWN: MemberState
MEMBER_STATE_DRAINING: MemberState
MEMBER_STATE_DRAINED: MemberState
MEMBER_STATE_REMOVED: MemberState
MEMBER_STATE_SWITCHING: MemberState

class JoinRequest(_message.Message):
    __slots__ = ("address", "role", "worker_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _worker_pb2.WorkerRole
    worker_id: str
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("address", "role", "worker_id", "state", "joined", "inflight", "placed_total", "num_free_blocks", "num_total_blocks", "max_num_batched_tokens")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    PLACED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _worker_pb2.WorkerRole
    worker_id: str
    state: MemberState
    joined: bool
    inflight: int
    placed_total: int
    num_free_blocks: int
    num_total_blocks: int
    max_num_batched_tokens: int
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ..., worker_id: _Optional[str] = ..., state: _Optional[_Union[MemberState, str]] = ..., joined: _Optional[bool] = ..., inflight: _Optional[int] = ..., placed_total: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerList(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Member]
    def __init__(self, workers: _Optional[_Iterable[_Union[Member, _Mapping]]] = ...) -> None: ...

class AddWorkerRequest(_message.Message):
    __slots__ = ("address", "role")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _worker_pb2.WorkerRole
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ...) -> None: ...

class MemberRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("address", "drain_timeout_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    drain_timeout_s: float
    def __init__(self, address: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("address", "role", "drain_timeout_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _worker_pb2.WorkerRole
    drain_timeout_s: float
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...
