"""The KV hand-off's vocabulary, shared by the engine's connector (engine/kv/connector.py) and the
transports that feed it (services/kv_transfer): the states of a receiving request, the error a
refused step raises (with the gRPC code the services answer with), the lease policy, what a
transport says about a block before its bytes, and what a reservation hands the prefill side.
Plain data only: no torch, no engine state."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class HandoffState(str, enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    READY = "ready"
    FAILED = "failed"
    EXPIRED = "expired"


class HandoffError(Exception):
    """A hand-off step was refused. ``code`` names the gRPC status the services answer with:
    NOT_FOUND, UNAUTHENTICATED, INVALID_ARGUMENT, DATA_LOSS, ABORTED, DEADLINE_EXCEEDED,
    FAILED_PRECONDITION or RESOURCE_EXHAUSTED."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    idle_s: float = 10.0     # a reservation lapses after this long without progress
    max_s: float = 300.0     # and never outlives this, whatever the progress (pins too)

    def __post_init__(self) -> None:
        if not 0 < self.idle_s <= self.max_s:
            raise ValueError(f"kv_lease_idle_s ({self.idle_s}) must be > 0 and <= kv_lease_max_s ({self.max_s})")


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a transport says about one block before its bytes arrive."""

    request_id: str
    block_index: int
    block_hash: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int
    layer_start: int = 0
    layer_end: int = 0
    head_start: int = 0     # KV heads [head_start, head_end) are carried; 0, 0: all of them
    head_end: int = 0


@dataclass(frozen=True, slots=True)
class Reservation:
    request_id: str
    needed_block_indices: list[int]     # blocks the prefill side must ship
    held_block_hashes: list[int]        # chain hashes of the leading blocks this pool already holds
    num_blocks: int
    transfer_token: bytes               # capability the blocks must be pushed with
    lease_s: float


@dataclass(frozen=True, slots=True)
class Failure:
    code: str
    message: str
