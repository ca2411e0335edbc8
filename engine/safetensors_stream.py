"""Write a ``.safetensors`` file tensor by tensor, chunk by chunk, without holding the tensors.

``safetensors.torch.save_file`` takes a dict of whole tensors and copies each one to bytes
before writing, so a checkpoint costs about twice its size in memory. Here the header is made
from the names, shapes and dtype alone, and then each tensor's data is written as its chunks
(consecutive slices along the first dimension) arrive, written on a thread while the next
chunk is made. The layout is the one ``save_file``
writes: an 8-byte little-endian header length, a compact JSON header with ``__metadata__``
first and the tensors sorted by name, padded with spaces to a multiple of 8 bytes, then the
data in header order. For one dtype the bytes equal ``save_file``'s.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _header(specs: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset, itemsize = 0, torch.empty((), dtype=dtype).element_size()
    for name, shape in specs:
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(path: str | Path, specs: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                      chunks: Callable[[str, tuple[int, ...]], Iterator[torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``specs`` (name, shape) of one ``dtype``; ``chunks(name, shape)`` yields the tensor's
    slices in order. Returns the file's size; raises ValueError if a tensor's chunks do not add
    up to its shape or are not of ``dtype``."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} is not one of {sorted(map(str, _DTYPE_NAMES))}")
    ordered = sorted(specs)
    header = _header(ordered, dtype, metadata or {})
    with open(path, "wb") as f, _Writer(f) as out:
        out.put(struct.pack("<Q", len(header)) + header)
        for name, shape in ordered:
            _write_tensor(out, name, shape, dtype, chunks(name, shape))
    return Path(path).stat().st_size


class _Writer:
    """Writes on a thread while the caller makes the next chunk (one write in flight)."""

    def __init__(self, f) -> None:
        self.f, self.pool, self.pending = f, ThreadPoolExecutor(1, thread_name_prefix="safetensors"), None

    def put(self, data) -> None:
        self.wait()
        self.pending = self.pool.submit(self.f.write, data)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending, pending = None, self.pending
            pending.result()

    def __enter__(self) -> "_Writer":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown()


def _write_tensor(out: _Writer, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  parts: Iterator[torch.Tensor]) -> None:
    rows = 0
    for part in parts:
        if part.dtype != dtype or tuple(part.shape[1:]) != tuple(shape[1:]) or part.dim() != len(shape):
            raise ValueError(f"{name}: a chunk of shape {tuple(part.shape)} {part.dtype} does not fit {shape} {dtype}")
        rows += part.shape[0] if shape else 1
        out.put(part.contiguous().reshape(-1).view(torch.uint8).numpy())
    if rows != (shape[0] if shape else 1):
        raise ValueError(f"{name}: chunks gave {rows} rows, the shape {shape} has {shape[0] if shape else 1}")
