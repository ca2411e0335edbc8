"""KV wire codecs (services/kv_transfer/wire_codec.py): exact lossless round trips, the int8 error
bound, every wire size bounded before allocation, and the per-link choice as plain arithmetic."""
from __future__ import annotations

import struct

import pytest
import torch
import zstandard

from pdserve.services.kv_transfer import wire_codec as kc

SHAPE = (2, 2, 16, 4, 64)      # [layers, k/v, block, heads, head_dim]


def _block(dtype: torch.dtype, seed: int = 0, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 20.0           # an outlier channel, as keys have
    x[:, :, 0] *= 8.0           # a loud token (an attention sink)
    return x.to(dtype).contiguous()


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_lossless_round_trip_is_exact(dtype: torch.dtype) -> None:
    x = _block(dtype)
    enc = kc.encode(_view(x), _name(dtype), SHAPE, "lossless")
    out = bytearray(x.numel() * x.element_size())
    got = kc.decode(enc.data, "lossless", _name(dtype), SHAPE, enc.raw_nbytes, memoryview(out))
    assert bytes(got) == bytes(_view(x))
    if dtype in (torch.bfloat16, torch.float16):
        assert enc.nbytes < enc.raw_nbytes        # the exponent plane compresses


def test_lossless_incompressible_high_plane_is_stored_raw() -> None:
    x = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    enc = kc.encode(_view(x), "uint8", (4096,), "lossless")
    assert bytes(kc.decode(enc.data, "lossless", "uint8", (4096,), 4096)) == bytes(_view(x))
    assert enc.nbytes <= 4096 + 32


def test_off_is_the_payload_itself() -> None:
    x = _block(torch.bfloat16)
    enc = kc.encode(_view(x), "bfloat16", SHAPE, "off")
    assert enc.nbytes == enc.raw_nbytes
    assert bytes(kc.decode(enc.data, "off", "bfloat16", SHAPE, enc.raw_nbytes)) == bytes(_view(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_error_is_within_half_a_step_per_token_head(dtype: torch.dtype) -> None:
    x = _block(dtype, seed=3)
    enc = kc.encode(_view(x), _name(dtype), SHAPE, "int8")
    assert enc.nbytes < 0.6 * enc.raw_nbytes or dtype is not torch.float32
    got = torch.frombuffer(bytearray(kc.decode(enc.data, "int8", _name(dtype), SHAPE, enc.raw_nbytes)),
                           dtype=dtype).reshape(SHAPE).float()
    xf = x.float()
    step = xf.abs().amax(dim=-1, keepdim=True) / 127.0           # one scale per (layer, k/v, token, head)
    rounding = got.abs() * (2.0 ** -8 if dtype is torch.bfloat16 else 2.0 ** -11 if dtype is torch.float16 else 0)
    err = (got - xf).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + rounding + 1e-30).all())
    assert float(err.max()) > 0                                   # it is lossy: the check can fail


def test_int8_refuses_non_finite_and_integer_inputs() -> None:
    x = _block(torch.bfloat16)
    x[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        kc.encode(_view(x), "bfloat16", SHAPE, "int8")
    with pytest.raises(ValueError, match="int8 codec takes"):
        kc.encode(memoryview(bytes(64)), "uint8", (64,), "int8")


def test_claimed_raw_size_over_expected_is_refused() -> None:
    x = _block(torch.bfloat16)
    enc = kc.encode(_view(x), "bfloat16", SHAPE, "lossless")
    with pytest.raises(ValueError, match="raw_nbytes"):
        kc.decode(enc.data, "lossless", "bfloat16", SHAPE, enc.raw_nbytes * 2)
    with pytest.raises(ValueError, match="limit"):
        kc.decode(enc.data, "lossless", "bfloat16", (1 << 20, 1 << 20), 1 << 41)
    lying = bytearray(enc.data)                                   # header claims a bigger block
    struct.pack_into("<Q", lying, 8, enc.raw_nbytes * 2)
    with pytest.raises(ValueError, match="header raw_nbytes"):
        kc.decode(lying, "lossless", "bfloat16", SHAPE, enc.raw_nbytes)


def _with_high_plane(frame: bytes, count: int) -> bytes:
    head = struct.pack("<4sBBBBQ", b"PDKC", 1, 1, 2, 0, count * 2)
    return head + struct.pack("<I", len(frame)) + frame + bytes(count)


def test_zstd_bomb_is_refused_before_allocation() -> None:
    count = 64
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(1 << 30))     # 1 GiB of zeros, ~tens of KiB
    assert len(bomb) < (1 << 20)
    with pytest.raises(ValueError, match="declares 1073741824 bytes, expected 64"):
        kc.decode(_with_high_plane(bomb, count), "lossless", "bfloat16", (count,), count * 2)
    sizeless = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1 << 24))
    with pytest.raises(ValueError, match="declares"):
        kc.decode(_with_high_plane(sizeless, count), "lossless", "bfloat16", (count,), count * 2)


def test_truncated_and_garbled_input_raise_value_error() -> None:
    x = _block(torch.bfloat16, seed=7)
    for codec in ("lossless", "int8"):
        enc = bytes(kc.encode(_view(x), "bfloat16", SHAPE, codec).data)
        n = x.numel() * 2
        for bad in (enc[:10], enc[:-1], enc + b"x", b"", b"NOPE" + enc[4:]):
            with pytest.raises(ValueError):
                kc.decode(bad, codec, "bfloat16", SHAPE, n)
        with pytest.raises(ValueError, match="codec id"):
            kc.decode(enc, "int8" if codec == "lossless" else "lossless", "bfloat16", SHAPE, n)
    enc = bytearray(kc.encode(_view(x), "bfloat16", SHAPE, "lossless").data)
    enc[16 + 4 + 6:16 + 4 + 40] = bytes(34)                      # inside the zstd frame
    with pytest.raises(ValueError, match="zstd"):
        kc.decode(enc, "lossless", "bfloat16", SHAPE, x.numel() * 2)
    with pytest.raises(ValueError, match="out must be writable"):
        kc.decode(kc.encode(_view(x), "bfloat16", SHAPE, "off").data, "off", "bfloat16", SHAPE,
                  x.numel() * 2, memoryview(bytearray(10)))


COSTS = kc.CodecCosts({"lossless": kc.CodecCost("lossless", raw_nbytes=1_000_000, encoded_nbytes=670_000,
                                                 encode_s=0.0005, decode_s=0.0004)})


def test_choose_compresses_on_a_slow_link_only() -> None:
    # 330 kB saved for 0.9 ms of codec time: worth it below ~367 MB/s, less the 10% margin
    assert COSTS.by_codec["lossless"].break_even_bytes_per_s == pytest.approx(330_000 / 0.0009)
    assert kc.choose(125e6, COSTS) == "lossless"                 # 1 Gbit/s
    assert kc.choose(1.25e9, COSTS) == "off"                     # 10 Gbit/s
    assert kc.choose(350e6, COSTS) == "off"                      # under break-even, inside the margin
    assert kc.choose(350e6, COSTS, margin=0.0) == "lossless"
    assert kc.choose(125e6, kc.CodecCosts()) == "off"            # nothing measured
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        kc.choose(0.0, COSTS)


def test_measure_costs_times_each_codec_on_the_sample() -> None:
    x = _block(torch.bfloat16)
    costs = kc.measure_costs(_view(x), "bfloat16", SHAPE)
    assert set(costs.by_codec) == {"lossless", "int8"}
    assert costs.by_codec["int8"].ratio > costs.by_codec["lossless"].ratio > 1.0
    assert all(c.encode_s > 0 and c.decode_s > 0 for c in costs.by_codec.values())


def test_link_estimator_is_an_ewma_of_large_transfers() -> None:
    est = kc.LinkEstimator(alpha=0.5, min_bytes=1000)
    assert est.rate is None
    est.observe(100, 1.0)                                         # too small: latency, not rate
    assert est.rate is None
    est.observe(10_000, 1.0)
    est.observe(30_000, 1.0)
    assert est.rate == pytest.approx(20_000)
