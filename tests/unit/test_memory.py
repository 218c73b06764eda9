"""Fresh result tensors (:mod:`baguahvd.backends.memory`)."""

from __future__ import annotations

import pytest
import torch

from baguahvd.backends import memory
from baguahvd.engine.buffers import FusionBuffers


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


class _Advice:
    """Stands in for madvise: records each (address, length, advice) and accepts it."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, address: int, length: int, advice: int) -> int:
        self.calls.append((address, length, advice))
        return 0


@pytest.mark.parametrize("nbytes", [memory.HUGE_PAGE_MIN_BYTES, (9 << 20) + 12])
def test_empty_like_advises_huge_pages_on_every_whole_huge_page_of_a_large_result(
    nbytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    advice = _Advice()
    monkeypatch.setattr(memory, "_MADVISE", advice)
    out = memory.empty_like(torch.empty(nbytes, dtype=torch.uint8))
    [(address, length, flag)] = advice.calls
    huge = 2 << 20
    first, end = out.data_ptr(), out.data_ptr() + nbytes
    assert flag == memory._MADV_HUGEPAGE
    assert address % huge == 0 and length % huge == 0
    # Inside the tensor, and every whole huge page of it.
    assert first <= address and address + length <= end
    assert address - first < huge and end - (address + length) < huge


def test_empty_like_leaves_small_and_non_cpu_results_alone(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    advice = _Advice()
    monkeypatch.setattr(memory, "_MADVISE", advice)
    memory.empty_like(torch.empty(memory.HUGE_PAGE_MIN_BYTES - 1, dtype=torch.uint8))
    memory.empty_like(torch.empty(memory.HUGE_PAGE_MIN_BYTES, dtype=torch.uint8, device="meta"))
    assert advice.calls == []


def test_empty_huge_starts_on_a_huge_page_and_advises_all_of_it(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    advice = _Advice()
    monkeypatch.setattr(memory, "_MADVISE", advice)
    count = (5 << 20) + 3
    out = memory.empty_huge(count, torch.float32)
    [(address, length, flag)] = advice.calls
    assert flag == memory._MADV_HUGEPAGE
    assert address == out.data_ptr() and address % (2 << 20) == 0
    # Every huge page the tensor touches, the last, partial one included.
    assert length == -(-out.nbytes // (2 << 20)) * (2 << 20)


@pytest.mark.parametrize("count", [1, 300 * 1024])
def test_a_small_tensor_is_on_a_huge_page_of_its_own_when_asked(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    advice = _Advice()
    monkeypatch.setattr(memory, "_MADVISE", advice)
    memory.empty_huge(count, torch.float32)
    assert advice.calls == []  # below the default threshold: an ordinary tensor
    out = memory.empty_huge(count, torch.float32, min_bytes=0)
    [(address, length, flag)] = advice.calls
    assert (address, length, flag) == (out.data_ptr(), 2 << 20, memory._MADV_HUGEPAGE)
    out.fill_(2)
    assert out.shape == (count,) and torch.all(out == 2)


def test_the_host_fusion_buffer_is_on_huge_pages_however_small(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    advice = _Advice()
    monkeypatch.setattr(memory, "_MADVISE", advice)
    buffers = FusionBuffers()
    buffer = buffers.get(torch.float32, 1000, torch.device("cpu"), host=True)
    [(address, length, _)] = advice.calls
    assert address == buffer.data_ptr() and length == 2 << 20
    buffers.get(torch.float64, 1000, torch.device("cpu"))  # not a host unit's: ordinary
    assert len(advice.calls) == 1


def test_a_reused_buffer_is_zeroed_and_on_huge_pages_from_its_threshold_on(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    advice = _Advice()
    monkeypatch.setattr(memory, "_MADVISE", advice)
    like = torch.ones(3, dtype=torch.float64)
    small = memory.zeros_buffer(memory.BUFFER_HUGE_MIN_BYTES // 8 - 1, like)
    assert advice.calls == []
    large = memory.zeros_buffer(memory.BUFFER_HUGE_MIN_BYTES // 8, like)
    [(address, _, _)] = advice.calls
    assert address == large.data_ptr()
    for buffer in (small, large):
        assert buffer.dtype == torch.float64 and buffer.dim() == 1 and not buffer.any()
    # A device tensor's buffer is made on its device (here a host tensor the package's CUDA
    # check calls a device one, as the stream model's are): never advised.
    monkeypatch.setattr(memory.cuda_support, "is_cuda", lambda tensor: True)
    memory.zeros_buffer(memory.BUFFER_HUGE_MIN_BYTES, like)
    assert len(advice.calls) == 1
