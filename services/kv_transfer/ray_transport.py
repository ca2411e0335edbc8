"""KV block transport through Ray's object store.

Sender (prefill side, ``RayKVSender``): each block is encoded with the
transport-neutral ``encode_block`` (header + CRC-32); the blocks' raw bytes are
put into the object store as flat ``numpy.uint8`` arrays (one object per chunk of
about 32 MiB holding one array per block: Ray stores numpy buffers out of band, as
raw bytes; nothing of ours is pickled), and the decode actor's ``push_blocks``
method is called with the serialized ``pdserve.v1.KVBlockHeader`` messages and the
object references. The call returns a serialized ``pdserve.v1.PushAck``, the same
acknowledgement the gRPC transport uses. Chunks are pipelined: one call per chunk,
the next chunk checksummed and put while the receiver handles the previous one.

Receiver (decode side, ``RayKVReceiver``): parses the headers, fetches the arrays
(zero-copy from shared memory on the same node; pulled by Ray from the sender's
node otherwise), checks that they are flat uint8 arrays, one per header, and hands
each block to ``BlockReceiver.deliver``: header checks, length + CRC-32, then the
``KVSink`` (the decode worker's ``DecodeHandler``: chain hash, layout, write into
the paged pool). Fail closed: any error rejects the block, the decode sink then
aborts the whole request, and the prefill side fails it.

Targets are ``ray://<namespace>/<actor-name>`` (or ``ray://<actor-name>`` for
the caller's namespace): the decode worker advertises this in
``WorkerStatus.kv_address`` and the router passes it on as the prefill
request's ``decode_address``.
"""

from __future__ import annotations

import asyncio
import math
import time
import warnings
from typing import Any, Sequence

import numpy as np

from pdserve.v1 import kv_pb2
from services.kv_transfer.base import (
    DEFAULT_MAX_BLOCK_BYTES,
    BlockReceiver,
    KVBlock,
    KVIntegrityError,
    KVSender,
    KVSink,
    KVTransportError,
    ReceiverStats,
    SendResult,
    encode_block,
)
from services.kv_transfer.grpc_transport import MAX_ERROR_CHARS, header_from_proto, header_to_proto

SCHEME = "ray://"
PUSH_METHOD = "push_blocks"   # the receiving actor's method: (headers: list[bytes], refs: list[ObjectRef]) -> bytes
DEFAULT_FETCH_TIMEOUT_S = 60.0
DEFAULT_CHUNK_BYTES = 32 << 20  # one object and one push_blocks call per ~32 MiB of blocks


def ray_kv_address(name: str, namespace: str | None = None) -> str:
    """The KV address a decode actor advertises: ``ray://<namespace>/<name>``."""
    return f"{SCHEME}{namespace}/{name}" if namespace else f"{SCHEME}{name}"


def parse_ray_target(target: str) -> tuple[str | None, str]:
    """``ray://ns/name`` -> ("ns", "name"); ``ray://name`` -> (None, "name")."""
    if not target.startswith(SCHEME):
        raise ValueError(f"not a Ray KV address: {target!r} (expected {SCHEME}[namespace/]actor-name)")
    rest = target[len(SCHEME):]
    namespace, _, name = rest.rpartition("/")
    if not name:
        raise ValueError(f"no actor name in {target!r}")
    return (namespace or None), name


def is_ray_target(target: str) -> bool:
    return target.startswith(SCHEME)


def _payload_arrays(payloads: Sequence[memoryview]) -> list[np.ndarray]:
    """Flat uint8 arrays over the block bytes (no copy here; ray.put copies them into the store)."""
    return [np.frombuffer(p, dtype=np.uint8) for p in payloads]


def _chunks(blocks: Sequence[KVBlock], chunk_bytes: int) -> list[list[KVBlock]]:
    """Consecutive groups of about chunk_bytes (at least one block each)."""
    out: list[list[KVBlock]] = [[]]
    size = 0
    for block in blocks:
        nbytes = math.prod(block.shape) * block.dtype.itemsize
        if out[-1] and size + nbytes > chunk_bytes:
            out.append([])
            size = 0
        out[-1].append(block)
        size += nbytes
    return out


class RayKVSender(KVSender):
    """Puts blocks into the object store and hands their references to the decode actor.

    Wire protocol: ``push_blocks(headers, refs)`` where ``headers`` are serialized
    ``KVBlockHeader`` messages and each ref is ONE object holding a list of flat uint8
    arrays; the arrays of all refs, in order, are the payloads of ``headers``, one each.
    One object per chunk (a ``ray.put`` costs a round trip to the store, so blocks are
    not put one by one), and one call per chunk of about ``chunk_bytes``: the next chunk
    is checksummed and put while the decode side verifies and copies the previous one.

    Must run in a process connected to Ray (an actor, or a driver after ``ray.init``).
    ``target`` is a ``ray://`` address; anything else goes through ``fallback``
    (e.g. a ``GrpcKVSender``) when one is given, so a prefill worker can serve
    decode workers of either transport.
    """

    def __init__(self, *, default_namespace: str | None = None, fallback: KVSender | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, put_in_thread_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.default_namespace = default_namespace
        self.fallback = fallback
        self.chunk_bytes = chunk_bytes
        # Chunks at least this large are copied into the store off the event loop.
        self.put_in_thread_bytes = put_in_thread_bytes
        self._actors: dict[str, Any] = {}

    def _actor(self, target: str) -> Any:
        handle = self._actors.get(target)
        if handle is None:
            import ray

            namespace, name = parse_ray_target(target)
            try:
                handle = ray.get_actor(name, namespace=namespace or self.default_namespace)
            except ValueError as exc:
                raise KVTransportError(f"no KV receiver actor at {target}: {exc}") from exc
            self._actors[target] = handle
        return handle

    async def _put(self, payloads: list[memoryview]) -> Any:
        import ray

        if sum(p.nbytes for p in payloads) >= self.put_in_thread_bytes:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, lambda: ray.put(_payload_arrays(payloads)))
        return ray.put(_payload_arrays(payloads))

    async def send_blocks(
        self, target: str, blocks: Sequence[KVBlock], *, timeout: float | None = None
    ) -> SendResult:
        if not is_ray_target(target):
            if self.fallback is None:
                raise KVTransportError(f"RayKVSender cannot reach {target!r} (no fallback transport)")
            return await self.fallback.send_blocks(target, blocks, timeout=timeout)
        self.check_blocks(blocks)
        stats = self.stats
        stats.send_calls += 1
        if not blocks:
            return SendResult(blocks=0, bytes=0, seconds=0.0)
        from ray.exceptions import RayError

        start = time.perf_counter()
        calls, nbytes = [], 0
        try:
            push = getattr(self._actor(target), PUSH_METHOD)
            for chunk in _chunks(blocks, self.chunk_bytes):
                encoded = [encode_block(b) for b in chunk]
                headers = [header_to_proto(h, 1 if h.nbytes else 0).SerializeToString() for h, _ in encoded]
                ref = await self._put([p for _, p in encoded])
                calls.append(push.remote(headers, [ref]))
                del ref   # the call holds it; the store frees it once the receiver is done
                nbytes += sum(h.nbytes for h, _ in encoded)
            waiting = asyncio.gather(*(_await_ref(c) for c in calls))
            acks = [kv_pb2.PushAck.FromString(a) for a in await (
                asyncio.wait_for(waiting, timeout) if timeout else waiting)]
        except (RayError, asyncio.TimeoutError) as exc:
            stats.failures += 1
            self._actors.pop(target, None)
            raise KVTransportError(f"push_blocks to {target} failed: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            stats.failures += 1
            raise
        finally:
            stats.seconds += time.perf_counter() - start
        stats.blocks_sent += len(blocks)
        stats.bytes_sent += nbytes
        accepted = sum(a.blocks_received for a in acks)
        rejected = [i for a in acks for i in a.rejected_block_indices]
        error = "; ".join(a.error for a in acks if a.error)
        if accepted + len(rejected) != len(blocks):   # fail closed on an inconsistent ack
            error = error or f"receiver accounted for {accepted + len(rejected)} of {len(blocks)} blocks"
            rejected = [b.block_index for b in blocks]
        stats.blocks_rejected += len(rejected)
        return SendResult(
            blocks=accepted,
            bytes=sum(a.bytes_received for a in acks),
            seconds=time.perf_counter() - start,
            rejected=rejected,
            error=error[:MAX_ERROR_CHARS],
        )

    async def close(self) -> None:
        self._actors.clear()
        if self.fallback is not None:
            await self.fallback.close()


async def _await_ref(ref: Any) -> Any:
    return await ref


class RayKVReceiver:
    """Decode side of the object-store transport: resolve, verify, deliver (fail closed).

    Call ``push_blocks`` from the receiving actor's method of the same name.
    """

    def __init__(self, sink: KVSink, *, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
                 fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S) -> None:
        self.receiver = BlockReceiver(sink, max_block_bytes=max_block_bytes)
        self.fetch_timeout_s = fetch_timeout_s
        # Arrays from the object store are read-only views of shared memory; the sink only
        # reads them (the decode pool copies each block in), so torch's warning is noise.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

    @property
    def stats(self) -> ReceiverStats:
        return self.receiver.stats

    async def push_blocks(self, headers: Sequence[bytes], refs: Sequence[Any]) -> bytes:
        """Receive blocks of one request; returns a serialized ``PushAck``."""
        rx = self.receiver
        rx.stats.streams += 1
        start = time.perf_counter()
        accepted, accepted_bytes, rejected, errors = 0, 0, [], []
        try:
            # Headers first: nothing is delivered from a call whose headers do not parse.
            parsed = []
            for raw in headers:
                try:
                    parsed.append(header_from_proto(kv_pb2.KVBlockHeader.FromString(bytes(raw))))
                except Exception as exc:  # noqa: BLE001 - malformed header: protocol error
                    rx.stats.failures += 1
                    return _ack(0, 0, [], [f"stream: bad header: {exc}"])
            try:
                payloads = await self._fetch(refs)
            except Exception as exc:  # noqa: BLE001 - lost object, bad type: every block refused
                for h in parsed:
                    rejected.append(h.block_index)
                    errors.append(rx.reject(h.block_index, f"object store: {type(exc).__name__}: {exc}"))
                return _ack(0, 0, rejected, errors)
            if len(payloads) != len(parsed):
                rx.stats.failures += 1
                return _ack(0, 0, [], [f"stream: {len(parsed)} headers for {len(payloads)} payloads"])
            request_id = parsed[0].request_id if parsed else ""
            for header, payload in zip(parsed, payloads):
                if header.request_id != request_id:
                    rejected.append(header.block_index)
                    errors.append(rx.reject(header.block_index, KVIntegrityError(
                        f"request_id {header.request_id!r} != call's {request_id!r}")))
                    continue
                reason = await rx.deliver(header, payload)   # header, length, CRC-32, then the sink
                if reason is None:
                    accepted += 1
                    accepted_bytes += header.nbytes
                else:
                    rejected.append(header.block_index)
                    errors.append(reason)
            return _ack(accepted, accepted_bytes, rejected, errors)
        finally:
            rx.stats.seconds += time.perf_counter() - start

    async def _fetch(self, refs: Sequence[Any]) -> list[memoryview]:
        values = await asyncio.wait_for(asyncio.gather(*(_await_ref(r) for r in refs)), self.fetch_timeout_s)
        out = []
        for value in values:
            if not isinstance(value, list):
                raise KVIntegrityError(f"object is {type(value).__name__}, expected a list of uint8 arrays")
            for arr in value:
                if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1:
                    raise KVIntegrityError(f"payload is {type(arr).__name__}, expected a flat uint8 array")
                out.append(memoryview(arr))
        return out


def _ack(accepted: int, nbytes: int, rejected: list[int], errors: list[str]) -> bytes:
    return kv_pb2.PushAck(
        blocks_received=accepted, bytes_received=nbytes, rejected_block_indices=rejected,
        error="; ".join(errors)[:MAX_ERROR_CHARS],
    ).SerializeToString()
