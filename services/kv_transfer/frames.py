"""KVFrame's hand encoding and zero-copy parsing (the standard protobuf wire format, so plain
generated stubs interoperate): the sender's payload is copied once, into the frame; the
receiver's payload is a view of the received message. Every frame after the stream opens is
sealed with its MAC as its last field (integrity.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from pdserve.v1 import kv_pb2
from pdserve.services.kv_transfer import integrity, shared_memory
from pdserve.services.kv_transfer.base import KVBlock

_OPEN, _HEADER, _PAYLOAD, _SHM, _MAC = 1, 2, 3, 4, 5
MAX_SEGMENT_BYTES = 64 << 20       # payload bytes per shared-memory segment

def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, data: bytes | memoryview) -> list[bytes | memoryview]:
    return [bytes([(number << 3) | 2]), _varint(len(data) if isinstance(data, bytes) else data.nbytes), data]


def _seal_parts(parts: list[bytes | memoryview], mac: "integrity.StreamMac | None",
                covered: Sequence[memoryview] = ()) -> list[bytes | memoryview]:
    """parts with the frame's MAC (over parts, then covered: a shared-memory segment's bytes) as
    the last field; no MAC when mac is None."""
    if mac is not None:
        parts = [*parts, *_field(_MAC, mac.seal([*parts, *covered]))]
    return parts


def _sealed(parts: list[bytes | memoryview], mac: "integrity.StreamMac | None",
            covered: Sequence[memoryview] = ()) -> bytes:
    """_seal_parts joined: the one copy of the payload."""
    return b"".join(_seal_parts(parts, mac, covered))


def encode_open(request_id: str, token: bytes, mac: "integrity.StreamMac | None" = None) -> bytes:
    opened = kv_pb2.KVStreamOpen(request_id=request_id, transfer_token=token,
                                 mac_algorithm=mac.name if mac is not None and mac.name != integrity.HMAC_SHA256 else "")
    return _sealed(_field(_OPEN, opened.SerializeToString()), mac)


def encode_heartbeat(mac: "integrity.StreamMac | None" = None) -> bytes:
    return _sealed([], mac)


def encode_probe(name: str, size: int) -> bytes:
    """The one frame of a shared-memory probe: an open without a request, naming a segment."""
    shm = kv_pb2.KVSharedMemory(name=name, size=size).SerializeToString()
    return b"".join([*_field(_OPEN, b""), *_field(_SHM, shm)])


def encode_shm_frames(blocks: Sequence[KVBlock], directory: str = shared_memory.SHM_DIR,
                      mac: "integrity.StreamMac | None" = None) -> tuple[list[bytes], list[str]]:
    """Serialized KVFrames whose payloads go through shared-memory segments in directory (whole
    blocks per frame, up to MAX_SEGMENT_BYTES each); returns the frames and the segments' names.
    Raises OSError when a segment cannot be written, after removing those it wrote."""
    frames: list[bytes] = []
    names: list[str] = []
    group: list[tuple[kv_pb2.KVBlockHeader, memoryview]] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group_bytes
        if not group:
            return
        name = shared_memory.write_segment([p for _, p in group], directory)
        names.append(name)
        shm = kv_pb2.KVSharedMemory(name=name, size=group_bytes).SerializeToString()
        parts = [x for h, _ in group for x in _field(_HEADER, h.SerializeToString())]
        frames.append(_sealed([*parts, *_field(_SHM, shm)], mac, [p for _, p in group]))
        group.clear()
        group_bytes = 0

    try:
        for block in blocks:
            header, payload = block.encode()
            if group and group_bytes + payload.nbytes > MAX_SEGMENT_BYTES:
                flush()
            group.append((header, payload))
            group_bytes += payload.nbytes
        flush()
    except OSError:
        for name in names:
            shared_memory.remove(name, directory)
        raise
    return frames, names


def encode_frames(blocks: Sequence[KVBlock], frame_bytes: int, mac: "integrity.StreamMac | None" = None,
                  target_bytes: int | None = None) -> list[bytes]:
    """Serialized KVFrames for blocks: headers announce each block in the frame where its bytes
    begin; payloads run back to back (see iter_wire_frames for where frames are cut)."""
    return encode_wire_frames([b.encode() for b in blocks], frame_bytes, mac, target_bytes)


def encode_wire_frames(encoded: Sequence[tuple[kv_pb2.KVBlockHeader, bytes | memoryview]], frame_bytes: int,
                       mac: "integrity.StreamMac | None" = None, target_bytes: int | None = None) -> list[bytes]:
    """As encode_frames, for blocks already encoded: (header, wire payload) pairs (wire_codec.py)."""
    return list(iter_wire_frames(encoded, frame_bytes, mac, target_bytes))


def iter_wire_frames(encoded: Sequence[tuple[kv_pb2.KVBlockHeader, bytes | memoryview]], frame_bytes: int,
                     mac: "integrity.StreamMac | None" = None, target_bytes: int | None = None) -> Iterator[bytes]:
    """The frames one at a time, each sealed as it is made (so the first can leave while the rest
    are built). Payloads are cut at frame_bytes (the message limit). With target_bytes, a frame
    also holds whole blocks only, up to target_bytes of payload (at least one block; one larger
    than frame_bytes still runs on across frames): whole blocks in one frame let the receiver
    write them into its pool straight from the message."""
    return map(b"".join, iter_frame_parts(encoded, frame_bytes, mac, target_bytes))


def iter_frame_parts(encoded: Iterable[tuple[kv_pb2.KVBlockHeader, bytes | memoryview]], frame_bytes: int,
                     mac: "integrity.StreamMac | None" = None, target_bytes: int | None = None
                     ) -> Iterator[list[bytes | memoryview]]:
    """As iter_wire_frames, each frame as its parts, unjoined: the payload stays a view of the
    blocks' own bytes (a socket writes the parts with one gather write, no copy)."""
    target = min(target_bytes, frame_bytes) if target_bytes else None
    parts: list[bytes | memoryview] = []
    chunks: list[memoryview] = []
    used = 0

    def sealed() -> list[bytes | memoryview]:
        nonlocal parts, chunks, used
        frame = _seal_parts([*parts, bytes([(_PAYLOAD << 3) | 2]), _varint(used), *chunks] if chunks else parts, mac)
        parts, chunks, used = [], [], 0
        return frame

    for header, payload in encoded:
        payload = memoryview(payload).cast("B")
        if target is not None and used and used + payload.nbytes > target:   # the block starts a frame
            yield sealed()
        parts.extend(_field(_HEADER, header.SerializeToString()))
        while payload.nbytes:
            if used == frame_bytes:
                yield sealed()
            take = min(frame_bytes - used, payload.nbytes)
            chunks.append(payload[:take])
            payload = payload[take:]
            used += take
    if parts or chunks:
        yield sealed()


@dataclass(slots=True)
class Frame:
    """A received KVFrame: the payload is a view of the message bytes; signed, the bytes its
    MAC covers (those before the mac field, which must be the last)."""

    open: kv_pb2.KVStreamOpen | None = None
    headers: list[kv_pb2.KVBlockHeader] = field(default_factory=list)
    payload: memoryview = memoryview(b"")
    shm: kv_pb2.KVSharedMemory | None = None
    mac: bytes = b""
    signed: memoryview = memoryview(b"")
    error: str = ""


def parse_frame(data: bytes) -> Frame:
    frame = Frame()
    view = memoryview(data)
    pos, end = 0, len(data)
    frame.signed = view
    try:
        while pos < end:
            start = pos
            key, pos = _read_varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 2:
                size, pos = _read_varint(data, pos)
                if pos + size > end:
                    raise ValueError("truncated field")
                chunk = view[pos:pos + size]
                pos += size
                if number == _MAC:
                    if pos != end:
                        raise ValueError("the mac field must be the frame's last")
                    frame.mac, frame.signed = bytes(chunk), view[:start]
                else:
                    _set_field(frame, number, chunk)
            elif wire == 0:
                _, pos = _read_varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                raise ValueError(f"wire type {wire}")
    except Exception as exc:  # noqa: BLE001 - any malformed input is the caller's error
        frame.error = f"malformed KVFrame: {exc}"
    return frame


@dataclass(slots=True)
class FrameHead:
    """A KVFrame's fields before its payload (frame: open, headers), and where its payload lies."""

    frame: Frame
    payload_at: int      # the payload's first byte in the frame
    payload_len: int


def parse_head(data: memoryview, total: int) -> FrameHead | None:
    """The fields of a frame of total bytes, of which data holds the first ones, up to its payload
    field: None while data ends before the payload begins (read more); a FrameHead with payload_at
    -1 when the frame has no payload before its MAC (or is malformed: parse_frame then says how)."""
    frame = Frame()
    pos, end = 0, data.nbytes
    try:
        while pos < total:
            if pos >= end:
                return None
            key, pos = _read_varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire != 2 or number in (_MAC, _SHM):
                return FrameHead(frame, -1, 0)
            size, pos = _read_varint(data, pos)
            if number == _PAYLOAD:
                return FrameHead(frame, pos, size) if pos + size <= total else FrameHead(frame, -1, 0)
            if pos + size > end:
                return None if pos + size <= total else FrameHead(frame, -1, 0)
            _set_field(frame, number, data[pos:pos + size])
            pos += size
    except ValueError:   # a varint cut at the end of data: read more (one past total: malformed)
        return None if end < total else FrameHead(frame, -1, 0)
    except Exception:  # noqa: BLE001 - a malformed message: parse_frame reports it on the whole frame
        return FrameHead(frame, -1, 0)
    return FrameHead(frame, -1, 0)


def _set_field(frame: Frame, number: int, chunk: memoryview) -> None:
    """A length-delimited field into frame (an unknown one is skipped)."""
    if number == _OPEN:
        frame.open = kv_pb2.KVStreamOpen.FromString(chunk)
    elif number == _HEADER:
        frame.headers.append(kv_pb2.KVBlockHeader.FromString(chunk))
    elif number == _PAYLOAD:
        frame.payload = chunk
    elif number == _SHM:
        frame.shm = kv_pb2.KVSharedMemory.FromString(chunk)


def parse_trailer(data: memoryview) -> bytes:
    """The MAC of a frame whose payload was its last field but one: data, what follows the
    payload, must be exactly the mac field (ValueError otherwise)."""
    key, pos = _read_varint(data, 0)
    if key != (_MAC << 3) | 2:
        raise ValueError("a KV frame's payload must be followed by its mac field alone")
    size, pos = _read_varint(data, pos)
    if pos + size != data.nbytes:
        raise ValueError("the mac field must be the frame's last")
    return bytes(data[pos:])


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("bad varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
