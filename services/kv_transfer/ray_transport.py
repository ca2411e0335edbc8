"""KV block transport through Ray's object store: the same stream semantics as gRPC.

Sender (prefill side, ``RayKVSender``): for each ``send`` the blocks are encoded (their wire codec:
``kv_compression``, default off), their wire bytes put into the object store as flat ``numpy.uint8`` arrays (one object
per chunk of about 32 MiB: a ``ray.put`` costs a round trip to the store; Ray keeps numpy
buffers out of band, as raw bytes), and the decode actor's ``push_blocks`` is called with the
serialized ``KVStreamOpen`` (request id + transfer token + the call's MAC over its headers and
payloads, keyed as over gRPC: frames.py), the serialized ``KVBlockHeader``s and the object
references. Heartbeats and a cancel are calls of their own. ``finish`` awaits
every call's ``PushAck``.

Receiver (decode side, ``RayKVReceiver``): checks the token and every header with the decode
engine's KV connector *before* fetching any object, fetches the arrays (zero-copy from shared
memory on the same node), checks the call's MAC over what it fetched, then hands each block to the connector, which verifies and stores
it, or fails the whole request. A refusal comes back as ``PushAck.error_code``.

Targets are ``ray://<namespace>/<actor-name>`` (or ``ray://<actor-name>``): the decode worker
advertises this in ``WorkerStatus.kv_address``.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from pdserve.engine.kv.handoff import HandoffError
from pdserve.v1 import kv_pb2
from pdserve.services.kv_transfer import frames
from pdserve.services.kv_transfer.base import KVBlock, KVSender, KVSink, KVStream, KVTransferError, SendResult
from pdserve.services.kv_transfer.receive_session import ReceiveSession
from pdserve.services.kv_transfer.wire_codec import check_mode, encode_blocks

SCHEME = "ray://"
DEFAULT_FETCH_TIMEOUT_S = 60.0
DEFAULT_CHUNK_BYTES = 32 << 20


def ray_kv_address(name: str, namespace: str | None = None) -> str:
    """The KV address a decode actor advertises: ``ray://<namespace>/<name>``."""
    return f"{SCHEME}{namespace}/{name}" if namespace else f"{SCHEME}{name}"


def parse_ray_target(target: str) -> tuple[str | None, str]:
    """``ray://ns/name`` -> ("ns", "name"); ``ray://name`` -> (None, "name")."""
    if not target.startswith(SCHEME):
        raise ValueError(f"not a Ray KV address: {target!r} (expected {SCHEME}[namespace/]actor-name)")
    namespace, _, name = target[len(SCHEME):].rpartition("/")
    if not name:
        raise ValueError(f"no actor name in {target!r}")
    return (namespace or None), name


def is_ray_target(target: str) -> bool:
    return target.startswith(SCHEME)


def _chunks(blocks: Sequence[KVBlock], chunk_bytes: int) -> list[list[KVBlock]]:
    """Consecutive groups of about chunk_bytes (at least one block each)."""
    out: list[list[KVBlock]] = [[]]
    size = 0
    for block in blocks:
        nbytes = math.prod(block.data.shape) * block.data.element_size()
        if out[-1] and size + nbytes > chunk_bytes:
            out.append([])
            size = 0
        out[-1].append(block)
        size += nbytes
    return out


async def _await(ref: Any) -> Any:
    return await ref


class RayKVStream(KVStream):
    def __init__(self, actor: Any, target: str, request_id: str, token: bytes, chunk_bytes: int,
                 put: Callable[[Any], Any], cluster_token: str | bytes | None = None, codec: str = "off") -> None:
        """codec: every block's wire codec (wire_codec.py; the call's MAC covers the encoded bytes)."""
        self._actor = actor
        self._request_id, self._token = request_id, token
        self._key = frames.mac_key(token, cluster_token)
        self._put = put
        self._target = target
        self._open = kv_pb2.KVStreamOpen(request_id=request_id, transfer_token=token).SerializeToString()
        self._chunk_bytes = chunk_bytes
        self._calls: list[Any] = []
        self._blocks = self._wire_bytes = 0
        self._codec = codec
        self._start = time.perf_counter()

    async def send(self, blocks: Sequence[KVBlock]) -> None:
        loop = asyncio.get_running_loop()
        for chunk in _chunks(blocks, self._chunk_bytes):
            if self._codec == "off":
                encoded = [b.encode() for b in chunk]
            else:   # CPU work off the loop
                encoded = await loop.run_in_executor(None, encode_blocks, chunk, self._codec)
            self._wire_bytes += sum(memoryview(p).nbytes for _, p in encoded)
            arrays = [np.frombuffer(payload, dtype=np.uint8) for _, payload in encoded]
            ref = await loop.run_in_executor(None, self._put, arrays)   # copies into the store off the loop
            headers = [h.SerializeToString() for h, _ in encoded]
            mac = frames.compute(self._key, [*headers, *(p for _, p in encoded)])
            opened = kv_pb2.KVStreamOpen(request_id=self._request_id, transfer_token=self._token,
                                         mac=mac).SerializeToString()
            self._calls.append(self._actor.push_blocks.remote(opened, headers, [ref]))
            self._blocks += len(chunk)

    async def heartbeat(self) -> None:
        self._actor.kv_heartbeat.remote(self._open)

    async def finish(self, timeout: float | None = None) -> SendResult:
        from ray.exceptions import RayError

        try:
            raw = await asyncio.wait_for(asyncio.gather(*(_await(c) for c in self._calls)), timeout)
        except RayError as exc:
            raise KVTransferError("UNAVAILABLE", f"push_blocks to {self._target}: {type(exc).__name__}: {exc}") from exc
        except asyncio.TimeoutError as exc:
            await self.cancel()
            raise KVTransferError("DEADLINE_EXCEEDED", f"KV not acknowledged within {timeout}s") from exc
        acks = [kv_pb2.PushAck.FromString(a) for a in raw]
        refused = next((a for a in acks if a.error_code), None)
        if refused is not None:
            raise KVTransferError(refused.error_code, refused.error)
        blocks = sum(a.blocks_received for a in acks)
        if blocks != self._blocks:
            raise KVTransferError("DATA_LOSS", f"receiver acknowledged {blocks} of {self._blocks} blocks")
        return SendResult(blocks, sum(a.bytes_received for a in acks), time.perf_counter() - self._start,
                          self._wire_bytes, self._codec)

    async def cancel(self) -> None:
        self._actor.kv_cancel.remote(self._open)


class RayKVSender(KVSender):
    """Sends to ``ray://`` targets through the object store; anything else through ``fallback``
    (e.g. a GrpcKVSender), so a prefill worker can serve decode workers of either transport.
    Must run in a process connected to Ray."""

    def __init__(self, *, default_namespace: str | None = None, fallback: KVSender | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, put: Callable[[Any], Any] | None = None,
                 cluster_token: str | bytes | None = None, kv_compression: str = "off") -> None:
        """cluster_token: keys each call's MAC with the transfer token (frames.py). kv_compression:
        the blocks' wire codec to ``ray://`` targets; ``auto`` sends them raw (no link estimate here:
        the object store moves them)."""
        self.codec = "off" if check_mode(kv_compression) == "auto" else kv_compression
        self.cluster_token = cluster_token
        self.default_namespace = default_namespace
        self.fallback = fallback
        self.chunk_bytes = chunk_bytes
        self.put = put          # None: ray.put
        self._actors: dict[str, Any] = {}

    def _actor(self, target: str) -> Any:
        handle = self._actors.get(target)
        if handle is None:
            import ray

            namespace, name = parse_ray_target(target)
            try:
                handle = ray.get_actor(name, namespace=namespace or self.default_namespace)
            except ValueError as exc:
                raise KVTransferError("UNAVAILABLE", f"no KV receiver actor at {target}: {exc}") from exc
            self._actors[target] = handle
        return handle

    def open(self, target: str, request_id: str, transfer_token: bytes) -> KVStream:
        if not is_ray_target(target):
            if self.fallback is None:
                raise KVTransferError("UNAVAILABLE", f"RayKVSender cannot reach {target!r} (no fallback transport)")
            return self.fallback.open(target, request_id, transfer_token)
        if self.put is None:
            import ray
            self.put = ray.put
        return RayKVStream(self._actor(target), target, request_id, transfer_token, self.chunk_bytes, self.put,
                           self.cluster_token, self.codec)

    async def close(self) -> None:
        self._actors.clear()
        if self.fallback is not None:
            await self.fallback.close()


class RayKVReceiver:
    """Decode side: call these from the receiving actor's methods of the same names."""

    def __init__(self, sink: KVSink, *, fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
                 cluster_token: str | bytes | None = None) -> None:
        self.sink = sink
        self.cluster_token = cluster_token
        self.fetch_timeout_s = fetch_timeout_s
        self.blocks_received = 0
        self.bytes_received = 0

    def _open(self, open_bytes: bytes) -> tuple[ReceiveSession, bytes]:
        """A session for the request that open_bytes (a serialized KVStreamOpen) names, authorized."""
        try:
            msg = kv_pb2.KVStreamOpen.FromString(bytes(open_bytes))
        except Exception as exc:  # noqa: BLE001 - malformed: the caller's error
            raise HandoffError("INVALID_ARGUMENT", f"malformed KVStreamOpen: {exc}") from None
        session = ReceiveSession(self.sink, self.cluster_token)
        session.open(msg.request_id, msg.transfer_token)
        return session, msg.mac

    async def push_blocks(self, open_bytes: bytes, headers: Sequence[bytes], refs: Sequence[Any]) -> bytes:
        """Receive blocks of one request; returns a serialized PushAck."""
        session = ReceiveSession(self.sink)
        try:
            session, mac = self._open(open_bytes)
            parsed = []
            for raw in headers:
                try:
                    parsed.append(kv_pb2.KVBlockHeader.FromString(bytes(raw)))
                except Exception as exc:  # noqa: BLE001
                    raise HandoffError("INVALID_ARGUMENT", f"malformed KVBlockHeader: {exc}") from None
            metas = session.announce_many(parsed)   # before anything is fetched
            payloads = await self._fetch(refs)
            if len(payloads) != len(metas):
                raise HandoffError("INVALID_ARGUMENT", f"{len(metas)} headers for {len(payloads)} payloads")
            session.verify_call([*(bytes(h) for h in headers), *payloads], mac)
            for meta, payload in zip(metas, payloads):
                session.accept(meta, payload)
            self.blocks_received += session.blocks
            self.bytes_received += session.bytes
            return session.ack().SerializeToString()
        except HandoffError as exc:
            session.fail(exc)
            return kv_pb2.PushAck(error_code=exc.code, error=str(exc)).SerializeToString()

    def heartbeat(self, open_bytes: bytes) -> None:
        with contextlib.suppress(HandoffError):
            self._open(open_bytes)[0].heartbeat()

    def cancel(self, open_bytes: bytes) -> None:
        with contextlib.suppress(HandoffError):
            self._open(open_bytes)[0].cancelled()

    async def _fetch(self, refs: Sequence[Any]) -> list[memoryview]:
        try:
            values = await asyncio.wait_for(asyncio.gather(*(_await(r) for r in refs)), self.fetch_timeout_s)
        except Exception as exc:  # noqa: BLE001 - lost object, timeout: the KV is gone
            raise HandoffError("DATA_LOSS", f"object store: {type(exc).__name__}: {exc}") from None
        out = []
        for value in values:
            if not isinstance(value, list):
                raise HandoffError("INVALID_ARGUMENT", f"object is {type(value).__name__}, expected a list of arrays")
            for arr in value:
                if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1:
                    raise HandoffError("INVALID_ARGUMENT", f"payload is {type(arr).__name__}, expected flat uint8")
                out.append(memoryview(arr))
        return out
