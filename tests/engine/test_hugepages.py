"""Huge-page buffers: zeroed and usable everywhere; aligned to 2 MiB where THP is available."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import hugepages


def test_zeros_on_huge_pages_when_available() -> None:
    t = hugepages.zeros((3, 2 << 20), torch.bfloat16)          # 12 MiB: above MIN_BYTES
    assert t.shape == (3, 2 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[1, 5] = 2.0
    assert t.sum().item() == 2.0
    if hugepages.enabled():
        assert t.data_ptr() % hugepages.HUGE_PAGE == 0


@pytest.mark.parametrize("mode", ["never", "unsupported"])
def test_without_thp_plain_zeroed_tensors(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setattr(hugepages, "thp_mode", lambda: mode)
    assert not hugepages.enabled()
    t = hugepages.zeros((4 << 20,), torch.uint8)
    assert not t.any()
    parts = [torch.ones(10), torch.arange(5)]
    assert hugepages.consolidate(parts) is parts                # unchanged, no copies
    assert not hugepages.collapse(t)


def test_consolidate_copies_into_one_arena() -> None:
    parts = [torch.randn(1000, 700).to(torch.bfloat16), torch.arange(3000, dtype=torch.int64).view(30, 100)]
    moved = hugepages.consolidate(parts)
    for a, b in zip(parts, moved):
        assert torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape
        assert b.data_ptr() % 64 == 0


def test_move_onto_huge_pages_moves_each_owner_in_arenas_of_a_bounded_size() -> None:
    class Owner:
        def __init__(self, t: torch.Tensor | None) -> None:
            self.packed = t

    mib = 1 << 20
    owners = [Owner(torch.randn(3 * mib // 4).to(torch.bfloat16)) for _ in range(5)] + [Owner(None)]   # 1.5 MiB each
    before = [o.packed.clone() if o.packed is not None else None for o in owners]
    hugepages.move_onto_huge_pages(owners, "packed", arena_bytes=3 * mib)
    assert owners[-1].packed is None
    for owner, want in zip(owners[:-1], before[:-1]):
        assert torch.equal(owner.packed, want) and owner.packed.data_ptr() % 64 == 0
    if hugepages.enabled():   # arenas of 2 owners (3 MiB), then the last alone
        bases = [o.packed.untyped_storage().data_ptr() for o in owners[:-1]]
        assert bases[0] == bases[1] and bases[2] == bases[3] and len(set(bases)) == 3
