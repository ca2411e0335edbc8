"""A KV stream's wire codec (kv.proto's ``KVBlockHeader.codec``): the prefill side's choice per
decode target (``--kv-compression``), each block's encode before it is framed (and MACed: the MAC
covers the bytes on the wire), and the receiver's checks and decode.

``auto`` (the prefill worker's default) chooses between ``off`` and ``lossless`` per decode target:
the first stream to a target goes ``off``; each stream's send phase (seconds the writer was busy,
plus the wait for the acknowledgement) feeds that target's LinkEstimator, and later streams take
``choose(rate, costs)``, with the codec's costs measured once per block geometry on the
first block that needs them. ``int8`` (lossy) is used only when asked; a dtype it cannot take goes
lossless. Shared-memory frames are never encoded (same host). Receivers decode any codec they know,
whatever their own flag.

The codecs: ``off``, ``lossless`` (byte-plane split + zstd on the high plane) and
``int8`` (lossy, opt-in), plus the per-link choice between them.

Lossless: a 2-byte float's high byte (sign + exponent) takes few values and compresses ~3x; the
low byte (mantissa) is near-random. So the high plane goes through zstd (fast strategy, min_match 7:
few matches, mostly Huffman literals — faster and smaller than level 1 on real KV, see
bench/kv_codecs.py) and every other plane is stored raw. 1-byte dtypes compress as one plane.

int8: symmetric int8 with one float32 scale per vector of the last dim — per (layer, k/v, token,
head) for a [layers, 2, block, heads, head_dim] block. Per token-head rather than per block-head:
tokens differ in magnitude (sinks, RoPE'd keys), and one loud token would coarsen a whole block's
head; the cost is 4 bytes per head_dim values (ratio ~1.9x for head_dim 64).

Encoded form (codecs other than ``off``): a 16-byte header ``<4sBBBBQ`` (magic, version, codec id,
itemsize, flags, raw_nbytes), then the body. Every size is checked against the caller's expected
size before anything is allocated; bad input raises ValueError naming the field and the limit.
"""
from __future__ import annotations

import math
import struct
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import zstandard

from pdserve.engine.kv.handoff import BlockMeta, HandoffError
from pdserve.services.kv_transfer.base import KVBlock, block_meta
from pdserve.v1 import kv_pb2


# ---- the codecs: a block's bytes, encoded and decoded ----

CODECS = ("off", "lossless", "int8")
LOSSLESS_CODECS = ("off", "lossless")     # what ``auto`` chooses between
MAX_RAW_NBYTES = 1 << 30                   # largest block decode accepts by default
MAX_DIMS = 8
MAX_ZSTD_WINDOW = 1 << 20                  # our frames use 2**17; refuse frames asking for more

_MAGIC = b"PDKC"
_VERSION = 1
_HEAD = struct.Struct("<4sBBBBQ")
_HI_LEN = struct.Struct("<I")
_CODEC_ID = {"lossless": 1, "int8": 2}
_FLAG_HI_RAW = 1                           # the high plane did not compress and is stored raw
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8, "uint8": torch.uint8,
}
_INT8_INPUTS = ("float32", "float16", "bfloat16")
_ZSTD_PARAMS = dict(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
                    strategy=zstandard.STRATEGY_FAST)
_local = threading.local()                 # zstd contexts are not thread-safe: one per thread


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(**_ZSTD_PARAMS))
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW)
    return d


@dataclass(frozen=True, slots=True)
class Encoded:
    """One block on the wire: ``data`` plus what decode needs besides it."""
    data: bytes | memoryview
    codec: str
    dtype: str
    shape: tuple[int, ...]
    raw_nbytes: int

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes


def _itemsize(dtype: str) -> int:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype].itemsize


def expected_nbytes(dtype: str, shape: tuple[int, ...], max_nbytes: int = MAX_RAW_NBYTES) -> int:
    """Raw size of dtype[shape], refusing shapes over MAX_DIMS dims or max_nbytes bytes."""
    if len(shape) > MAX_DIMS:
        raise ValueError(f"shape has {len(shape)} dims, limit {MAX_DIMS}")
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape {list(shape)} must be non-negative ints")
    n = math.prod(shape) * _itemsize(dtype)
    if n > max_nbytes:
        raise ValueError(f"shape {list(shape)} of {dtype} is {n} bytes, limit {max_nbytes}")
    return n


def max_encoded_nbytes(codec: str, dtype: str, shape: tuple[int, ...], max_nbytes: int = MAX_RAW_NBYTES) -> int:
    """The most bytes ``codec`` may put on the wire for dtype[shape]: what a receiver checks a
    header's encoded size against before allocating (lossless: raw size + headers, its high plane
    stored raw at worst; int8: exact)."""
    n = expected_nbytes(dtype, tuple(shape), max_nbytes)
    if codec == "off":
        return n
    if codec == "lossless":
        return _HEAD.size + _HI_LEN.size + n
    if codec == "int8":
        if dtype not in _INT8_INPUTS:
            raise ValueError(f"int8 codec takes {_INT8_INPUTS}, not {dtype!r}")
        numel = n // _itemsize(dtype)
        d = shape[-1] if shape else 1
        return _HEAD.size + 4 * (numel // d if d else 0) + numel
    raise ValueError(f"codec {codec!r} is not one of {CODECS}")


def _tensor(buf: memoryview, dtype: torch.dtype, count: int = -1, offset: int = 0) -> torch.Tensor:
    with warnings.catch_warnings():        # read-only buffers are only read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


# ---- encode ------------------------------------------------------------------------------------
def encode(payload: memoryview, dtype: str, shape: tuple[int, ...], codec: str) -> Encoded:
    """Encode one block's raw bytes (dtype[shape], C order). ``off`` returns the payload itself."""
    payload = memoryview(payload).cast("B")
    n = expected_nbytes(dtype, tuple(shape))
    if payload.nbytes != n:
        raise ValueError(f"payload is {payload.nbytes} bytes, {dtype}{list(shape)} is {n}")
    if codec == "off":
        return Encoded(payload, codec, dtype, tuple(shape), n)
    if codec == "lossless":
        body, flags = _encode_lossless(payload, _itemsize(dtype))
    elif codec == "int8":
        body, flags = _encode_int8(payload, dtype, tuple(shape)), 0
    else:
        raise ValueError(f"codec {codec!r} is not one of {CODECS}")
    head = _HEAD.pack(_MAGIC, _VERSION, _CODEC_ID[codec], _itemsize(dtype), flags, n)
    return Encoded(b"".join([head, *body]), codec, dtype, tuple(shape), n)


def _encode_lossless(payload: memoryview, k: int) -> tuple[list[bytes | memoryview], int]:
    planes = np.frombuffer(payload, dtype=np.uint8).reshape(-1, k)
    hi = np.ascontiguousarray(planes[:, k - 1])
    low = np.ascontiguousarray(planes[:, :k - 1]) if k > 1 else np.empty(0, np.uint8)
    packed = _compressor().compress(hi)
    flags = 0
    if len(packed) >= hi.nbytes:
        packed, flags = hi.tobytes(), _FLAG_HI_RAW
    return [_HI_LEN.pack(len(packed)), packed, memoryview(low).cast("B")], flags


def _encode_int8(payload: memoryview, dtype: str, shape: tuple[int, ...]) -> list[bytes]:
    if dtype not in _INT8_INPUTS:
        raise ValueError(f"int8 codec takes {_INT8_INPUTS}, not {dtype!r}")
    d = shape[-1] if shape else 1
    x = _tensor(payload, _DTYPES[dtype]).reshape(-1, d).float()   # (groups, head_dim)
    scale = x.abs().amax(dim=1) / 127.0
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("int8 codec: payload holds non-finite values (send it lossless)")
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127).to(torch.int8)
    return [scale.numpy().tobytes(), q.numpy().tobytes()]


# ---- decode ------------------------------------------------------------------------------------
def decode(encoded: bytes | memoryview, codec: str, dtype: str, shape: tuple[int, ...], raw_nbytes: int,
           out: memoryview | None = None, max_nbytes: int = MAX_RAW_NBYTES) -> memoryview:
    """Decode one block into ``out`` (writable, exactly dtype[shape] bytes) or a new buffer; returns it.
    ``dtype``/``shape`` are what the caller expects (its reservation); ``raw_nbytes`` is the wire's claim."""
    n = expected_nbytes(dtype, tuple(shape), max_nbytes)
    if raw_nbytes != n:
        raise ValueError(f"raw_nbytes {raw_nbytes} != expected {n} for {dtype}{list(shape)}")
    if out is None:
        out = memoryview(bytearray(n))
    out = memoryview(out).cast("B")
    if out.readonly or out.nbytes != n:
        raise ValueError(f"out must be writable and {n} bytes, got {out.nbytes} (readonly={out.readonly})")
    data = memoryview(encoded).cast("B")
    if codec == "off":
        if data.nbytes != n:
            raise ValueError(f"off: encoded is {data.nbytes} bytes, expected {n}")
        out[:] = data
        return out
    if codec not in _CODEC_ID:
        raise ValueError(f"codec {codec!r} is not one of {CODECS}")
    if data.nbytes < _HEAD.size:
        raise ValueError(f"{codec}: encoded is {data.nbytes} bytes, shorter than its {_HEAD.size}-byte header")
    magic, version, cid, itemsize, flags, claimed = _HEAD.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise ValueError(f"{codec}: bad header magic {magic!r} / version {version} (want {_MAGIC!r} / {_VERSION})")
    if cid != _CODEC_ID[codec] or itemsize != _itemsize(dtype):
        raise ValueError(f"{codec}: header codec id {cid} / itemsize {itemsize} do not match {codec} / {dtype}")
    if claimed != n:
        raise ValueError(f"{codec}: header raw_nbytes {claimed} != expected {n}")
    body = data[_HEAD.size:]
    if codec == "lossless":
        _decode_lossless(body, itemsize, flags, out)
    else:
        _decode_int8(body, dtype, tuple(shape), out)
    return out


def _decode_lossless(body: memoryview, k: int, flags: int, out: memoryview) -> None:
    count = out.nbytes // k
    if body.nbytes < _HI_LEN.size:
        raise ValueError("lossless: body shorter than its high-plane length field")
    (hi_len,) = _HI_LEN.unpack_from(body)
    want = _HI_LEN.size + hi_len + count * (k - 1)
    if body.nbytes != want:
        raise ValueError(f"lossless: body is {body.nbytes} bytes, its high-plane length {hi_len} implies {want}")
    packed = body[_HI_LEN.size:_HI_LEN.size + hi_len]
    if flags & _FLAG_HI_RAW:
        if hi_len != count:
            raise ValueError(f"lossless: raw high plane is {hi_len} bytes, expected {count}")
        hi = packed
    else:
        hi = _unzstd(packed, count)
    planes = np.frombuffer(out, dtype=np.uint8).reshape(-1, k)
    planes[:, k - 1] = np.frombuffer(hi, dtype=np.uint8)
    if k > 1:
        planes[:, :k - 1] = np.frombuffer(body, np.uint8, count * (k - 1), _HI_LEN.size + hi_len).reshape(-1, k - 1)


def _unzstd(frame: memoryview, expected: int) -> bytes:
    """One zstd frame that must hold exactly ``expected`` bytes: the frame's declared size is
    checked before decompressing, so a small frame claiming (or yielding) more is refused unallocated."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise ValueError(f"lossless: high plane is not a zstd frame ({exc})") from None
    if params.content_size != expected:   # CONTENTSIZE_UNKNOWN is refused too: our frames declare it
        raise ValueError(f"lossless: zstd frame declares {params.content_size} bytes, expected {expected}")
    if params.window_size > MAX_ZSTD_WINDOW:
        raise ValueError(f"lossless: zstd window {params.window_size} bytes, limit {MAX_ZSTD_WINDOW}")
    try:
        hi = _decompressor().decompress(frame, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise ValueError(f"lossless: corrupt zstd frame ({exc})") from None
    if len(hi) != expected:
        raise ValueError(f"lossless: high plane decoded to {len(hi)} bytes, expected {expected}")
    return hi


def _decode_int8(body: memoryview, dtype: str, shape: tuple[int, ...], out: memoryview) -> None:
    if dtype not in _INT8_INPUTS:
        raise ValueError(f"int8 codec decodes to {_INT8_INPUTS}, not {dtype!r}")
    numel = out.nbytes // _itemsize(dtype)
    d = shape[-1] if shape else 1
    groups = numel // d if d else 0
    want = 4 * groups + numel
    if body.nbytes != want:
        raise ValueError(f"int8: body is {body.nbytes} bytes, expected {want} ({groups} scales + {numel} values)")
    if numel == 0:
        return
    scale = _tensor(body, torch.float32, groups, 0)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError("int8: scales must be finite and non-negative")
    q = _tensor(body, torch.int8, numel, 4 * groups).reshape(groups, d)
    dst = _tensor(out, _DTYPES[dtype]).reshape(groups, d)
    dst.copy_(q.float() * scale[:, None])


# ---- choosing a codec per link -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CodecCost:
    """One codec measured on a sample: sizes and seconds for that sample."""
    codec: str
    raw_nbytes: int
    encoded_nbytes: int
    encode_s: float
    decode_s: float

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / max(self.encoded_nbytes, 1)

    def seconds_per_raw_byte(self, link_bytes_per_s: float) -> float:
        """Encode + wire + decode time per raw byte (stages counted in series: conservative)."""
        return (self.encoded_nbytes / link_bytes_per_s + self.encode_s + self.decode_s) / max(self.raw_nbytes, 1)

    @property
    def break_even_bytes_per_s(self) -> float:
        """Link rate below which this codec beats sending raw: bytes saved per codec second."""
        spent = self.encode_s + self.decode_s
        return (self.raw_nbytes - self.encoded_nbytes) / spent if spent > 0 else math.inf


@dataclass(frozen=True, slots=True)
class CodecCosts:
    by_codec: dict[str, CodecCost] = field(default_factory=dict)


def choose(link_bytes_per_s: float, costs: CodecCosts, candidates: tuple[str, ...] = LOSSLESS_CODECS,
           margin: float = 0.1) -> str:
    """The candidate with the least encode + wire + decode time; a codec other than ``off`` only
    if it beats sending raw by ``margin`` (0.1: 10% faster). ``auto`` uses the lossless candidates."""
    if not link_bytes_per_s > 0:
        raise ValueError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s}")
    raw_s = 1.0 / link_bytes_per_s
    best, best_s = "off", raw_s
    for name in candidates:
        cost = costs.by_codec.get(name)
        if name == "off" or cost is None:
            continue
        s = cost.seconds_per_raw_byte(link_bytes_per_s)
        if s * (1.0 + margin) < raw_s and s < best_s:
            best, best_s = name, s
    return best


def measure_costs(sample: memoryview, dtype: str, shape: tuple[int, ...],
                  codecs: tuple[str, ...] = ("lossless", "int8"), repeats: int = 3) -> CodecCosts:
    """Time each codec on one sample block (best of ``repeats``); codecs the dtype cannot take are left out."""
    out = memoryview(bytearray(memoryview(sample).nbytes))
    by_codec: dict[str, CodecCost] = {}
    for codec in codecs:
        if codec == "int8" and dtype not in _INT8_INPUTS:
            continue
        enc_s = dec_s = math.inf
        for _ in range(max(repeats, 1)):
            t0 = time.perf_counter()
            enc = encode(sample, dtype, shape, codec)
            t1 = time.perf_counter()
            decode(enc.data, codec, dtype, shape, enc.raw_nbytes, out)
            t2 = time.perf_counter()
            enc_s, dec_s = min(enc_s, t1 - t0), min(dec_s, t2 - t1)
        by_codec[codec] = CodecCost(codec, enc.raw_nbytes, enc.nbytes, enc_s, dec_s)
    return CodecCosts(by_codec)


class LinkEstimator:
    """EWMA of a link's bytes/s from completed transfers (``observe``); ``rate`` is None until the first.
    Transfers under ``min_bytes`` are ignored: their time is mostly latency, not rate."""

    def __init__(self, alpha: float = 0.3, min_bytes: int = 256 << 10) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha, self.min_bytes = alpha, min_bytes
        self._rate: float | None = None
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < self.min_bytes or not seconds > 0:
            return
        sample = nbytes / seconds
        with self._lock:
            self._rate = sample if self._rate is None else self.alpha * sample + (1 - self.alpha) * self._rate

    @property
    def rate(self) -> float | None:
        return self._rate


# ---- on the wire: a block's header and payload, the codec policy ----

MODES = ("auto", *CODECS)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"kv_compression must be one of {MODES}, got {mode!r}")
    return mode


# ---- sender --------------------------------------------------------------------------------------
def encode_block(block: KVBlock, codec: str) -> tuple[kv_pb2.KVBlockHeader, memoryview | bytes]:
    """The block's header and wire payload under codec. ``int8`` on a dtype (or values) it cannot
    take goes lossless; an encoding no smaller than the raw bytes goes ``off`` (header.codec unset)."""
    header, payload = block.encode()
    if codec == "off":
        return header, payload
    shape = tuple(header.shape)
    try:
        enc = encode(payload, header.dtype, shape, codec)
    except ValueError:
        if codec != "int8":
            raise
        enc = encode(payload, header.dtype, shape, "lossless")
    if enc.nbytes >= payload.nbytes:
        return header, payload
    header.codec, header.raw_nbytes, header.nbytes = enc.codec, header.nbytes, enc.nbytes
    return header, enc.data


def encode_blocks(blocks: Sequence[KVBlock], codec: str) -> list[tuple[kv_pb2.KVBlockHeader, memoryview | bytes]]:
    return [encode_block(b, codec) for b in blocks]


class CodecPolicy:
    """The prefill side's codec per decode target (see the module docstring); thread-safe."""

    def __init__(self, mode: str = "off", margin: float = 0.1) -> None:
        self.mode = check_mode(mode)
        self.margin = margin
        self._links: dict[str, LinkEstimator] = {}
        self._costs: dict[tuple[str, tuple[int, ...]], CodecCosts] = {}
        self._lock = threading.Lock()

    def link(self, target: str) -> LinkEstimator:
        """Target's link estimator (created empty on first use)."""
        with self._lock:
            return self._links.setdefault(target, LinkEstimator())

    def observe(self, target: str, wire_bytes: int, seconds: float) -> None:
        """A finished stream's send phase to target: wire_bytes in seconds."""
        self.link(target).observe(wire_bytes, seconds)

    def costs(self, block: KVBlock) -> CodecCosts:
        """The lossless codec's measured cost on this block's geometry (measured once, on block)."""
        header, payload = block.encode()
        key = (header.dtype, tuple(header.shape))
        with self._lock:
            known = self._costs.get(key)
        if known is None:
            known = measure_costs(payload, header.dtype, key[1], codecs=("lossless",))
            with self._lock:
                self._costs.setdefault(key, known)
        return known

    def pick(self, target: str, sample: KVBlock) -> str:
        """The codec of a new stream to target, whose first block is sample (CPU work: off the loop)."""
        if self.mode != "auto":
            return self.mode
        rate = self.link(target).rate
        if rate is None:
            return "off"
        return choose(rate, self.costs(sample), margin=self.margin)


# ---- receiver ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WireMeta:
    """A received header: the block as the connector sees it (raw size), its codec, its wire size."""
    meta: BlockMeta
    codec: str = "off"
    nbytes: int = 0


def wire_meta(header: kv_pb2.KVBlockHeader) -> WireMeta:
    """Header checked before anything is allocated: a known codec (INVALID_ARGUMENT naming
    header.codec), the raw size against dtype and shape (block_meta), the wire size against the
    codec's bound for it (INVALID_ARGUMENT naming header.nbytes)."""
    codec = header.codec or "off"
    if codec not in CODECS:
        raise HandoffError("INVALID_ARGUMENT", f"block {header.block_index}: header.codec {header.codec!r} is not one "
                                               f"of {CODECS}")
    meta = block_meta(header)
    if codec == "off":
        return WireMeta(meta, codec, meta.nbytes)
    try:
        limit = max_encoded_nbytes(codec, header.dtype, tuple(header.shape))
    except ValueError as exc:
        raise HandoffError("INVALID_ARGUMENT", f"block {header.block_index}: header.codec {codec!r}: {exc}") from None
    if header.nbytes > limit:
        raise HandoffError("INVALID_ARGUMENT", f"block {header.block_index}: header.nbytes {header.nbytes} exceeds "
                                               f"{limit}, the {codec} limit for raw_nbytes {meta.nbytes}")
    return WireMeta(meta, codec, header.nbytes)


def decode_payload(wire: WireMeta, payload: memoryview | bytes | bytearray) -> memoryview | bytes | bytearray:
    """The block's raw bytes (exactly meta.nbytes) from its wire payload; DATA_LOSS on any codec error."""
    if wire.codec == "off":
        return payload
    meta = wire.meta
    try:
        return decode(payload, wire.codec, meta.dtype, meta.shape, meta.nbytes)
    except ValueError as exc:
        raise HandoffError("DATA_LOSS", f"block {meta.block_index}: header.codec {wire.codec!r}: {exc}") from None
