"""Fresh result tensors (:mod:`baguahvd.backends.memory`)."""

from __future__ import annotations

import pytest
import torch

from baguahvd.backends import memory


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 5), torch.float32), (((1 << 20) + 3,), torch.float64), ((2048, 1024, 3), torch.int8)],
    ids=str,
)
def test_empty_like_is_an_ordinary_tensor_of_the_same_kind(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    source = torch.zeros(shape, dtype=dtype)
    out = memory.empty_like(source)
    assert out.shape == source.shape and out.dtype == dtype and out.is_contiguous()
    assert out.data_ptr() != source.data_ptr()
    out.fill_(1)
    assert torch.all(out == 1)
    out.resize_(out.numel() + 1)  # the caller's own, resizable storage


@pytest.mark.parametrize(
    ("count", "dtype"),
    [(17, torch.float32), ((4 << 20) + 5, torch.float32), ((3 << 20) + 1, torch.float64),
     (5 << 20, torch.int8)],
    ids=str,
)
def test_empty_huge_is_a_flat_writable_tensor(count: int, dtype: torch.dtype) -> None:
    out = memory.empty_huge(count, dtype)
    assert out.shape == (count,) and out.dtype == dtype and out.is_contiguous()
    if out.nbytes >= memory.HUGE_PAGE_MIN_BYTES and memory._MADVISE is not None:
        assert out.data_ptr() % (2 << 20) == 0
    out.fill_(3)
    assert torch.all(out == 3)
