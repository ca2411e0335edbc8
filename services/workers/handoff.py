"""A prefill's KV hand-off: the blocks its decode worker needs, on their way there.

The transport is chosen once per request, when its hand-off opens (``HandoffRoutes.open``):
the decode worker's raw TCP data plane when the target names one and this worker can reach such
planes (over gRPC after all when that plane cannot be had: TcpKVStream's fallback), else this
worker's sender (gRPC, through shared memory to a worker on the same host, or Ray's object
store). A target that needs no block gets a hand-off with no transport. Every hand-off answers
the same calls: ``send`` a step's ready blocks, ``heartbeat``, ``finish`` (wait for the
acknowledgement of every block), ``close`` (cancel unless finished)."""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from pdserve.engine.kv.block_manager import salt_root, transfer_block_hashes
from pdserve.v1 import worker_pb2
from pdserve.services.kv_transfer import KVBlock, KVSender, KVStream, SendResult

# Exported blocks as AsyncEngine gives them (StepResult.blocks): (head_start, head_end, data) per slice.
BlockPieces = list[tuple[int, int, torch.Tensor]]


class Handoff:
    """A hand-off with nothing to ship (the decode worker holds every block): every call is a no-op."""

    ships = False        # blocks go to the decode worker
    takes_views = False  # blocks may be views of pinned pool blocks (KVStream.takes_views)

    def __init__(self, target: str = "") -> None:
        self.target = target   # the decode worker's address, for error messages

    def wanted(self, ready: Sequence[int]) -> list[int]:
        """The blocks among ready that the decode worker needs."""
        return []

    async def send(self, ready: Sequence[int], pieces: BlockPieces) -> None:
        """Queue the needed ones among a step's ready blocks (their pieces, as exported)."""

    async def heartbeat(self) -> None:
        """Tell the decode worker the prefill is still working (its reservation's lease goes on)."""

    async def finish(self, timeout: float | None = None) -> SendResult:
        """Wait until every sent block is acknowledged; raises KVTransferError."""
        return SendResult(0, 0, 0.0, codec="", streams=0)

    async def close(self) -> None:
        """Cancel the transfer unless it finished (the decode worker then frees its reservation)."""


class StreamHandoff(Handoff):
    """A hand-off over one transport's stream to the decode worker."""

    ships = True

    def __init__(self, request_id: str, target: str, stream: KVStream, needed: set[int], hashes: list[int]) -> None:
        super().__init__(target)
        self.request_id = request_id
        self.stream = stream
        self.needed = needed
        self.hashes = hashes          # every block's chain hash, which the receiver checks
        self.takes_views = stream.takes_views
        self.finished = False

    def wanted(self, ready: Sequence[int]) -> list[int]:
        return [i for i in ready if i in self.needed]

    async def send(self, ready: Sequence[int], pieces: BlockPieces) -> None:
        await self.stream.send([KVBlock(self.request_id, idx, self.hashes[idx], data[j], head_start=start,
                                        head_end=end)
                                for j, idx in enumerate(ready) if idx in self.needed for start, end, data in pieces])

    async def heartbeat(self) -> None:
        await self.stream.heartbeat()

    async def finish(self, timeout: float | None = None) -> SendResult:
        result = await self.stream.finish(timeout=timeout)
        self.finished = True
        return result

    async def close(self) -> None:
        if not self.finished:
            await self.stream.cancel()


class HandoffRoutes:
    """This worker's ways to a decode worker: sender (gRPC, shared memory or Ray), and data_sender
    for a target that names a raw TCP data plane (KVTarget.data_address; None: never)."""

    def __init__(self, sender: KVSender, data_sender: KVSender | None, block_size: int) -> None:
        self.sender = sender
        self.data_sender = data_sender
        self.block_size = block_size

    def open(self, request: worker_pb2.PrefillRequest) -> Handoff:
        """The request's hand-off to its target, over the transport chosen here, once."""
        target, rid = request.target, request.request_id
        needed = set(target.needed_block_indices)
        if not needed:
            return Handoff(target.address)
        salt = request.params.cache_salt if request.params.HasField("cache_salt") else None
        hashes = transfer_block_hashes([*request.prompt_token_ids, *request.output_token_ids], self.block_size,
                                       salt_root(salt))
        return StreamHandoff(rid, target.address, self._stream(rid, target), needed, hashes)

    def _stream(self, rid: str, target: worker_pb2.KVTarget) -> KVStream:
        grpc_stream = functools.partial(self.sender.open, target.address, rid, target.transfer_token)
        if target.data_address and self.data_sender is not None:
            return self.data_sender.open(target.data_address, rid, target.transfer_token, fallback=grpc_stream)
        return grpc_stream()
