"""Fresh CPU tensors for the results of collectives, and the buffers they are reduced in.

An out-of-place result is new memory that the collective writes whole, and for a large
tensor the first touch of its pages costs as much as the reduction: the kernel faults in
and zeroes one 4 KB page at a time (on one machine an allreduce into a fresh 64 MB output
took several times as long as into reused memory; ``benchmarks/results/shared_memory/NOTES.md``).
:func:`empty_like` asks Linux
for transparent huge pages on the 2 MB-aligned part of a large allocation, as NumPy does
for its own arrays of 4 MB and more, so the same memory arrives in 512 times fewer faults.
The memory stays the caller's ordinary tensor; nothing is pooled or shared.

Buffers that collectives reduce again and again (the engine's fusion buffer, gradient
buckets) live on huge pages whatever their size, from a quarter of a megabyte on
(:func:`zeros_buffer`): Open MPI reads and writes them between ranks, and reduces 256 KB
of them in three quarters of the time it takes on 4 KB pages, 1 MB and more in about half
(``benchmarks/huge_pages.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

import torch

from baguahvd.backends import cuda_support

HUGE_PAGE_MIN_BYTES = 4 << 20
"""Allocations from this size on are advised to use huge pages (NumPy's threshold)."""
BUFFER_HUGE_MIN_BYTES = 256 << 10
"""Reused buffers from this size on live on huge pages (:func:`zeros_buffer`); a smaller
one would leave most of its 2 MB page unused."""

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise  # type: ignore[no-any-return]


_MADVISE = _madvise()


def empty_huge(
    count: int, dtype: torch.dtype, min_bytes: int = HUGE_PAGE_MIN_BYTES
) -> torch.Tensor:
    """A flat CPU tensor of ``count`` elements on whole huge pages where Linux grants them:
    the allocation is padded so that the tensor starts on a 2 MB boundary and ends within
    whole huge pages, all of them advised before they are touched. For long-lived buffers
    the engine reuses (the fusion buffer): Open MPI's single-copy transfers between ranks
    read and write them with 512 times fewer page lookups, and a large message on 4 KB pages
    costs about a third more (``benchmarks/results/shared_memory/NOTES.md``). Tensors of
    fewer than ``min_bytes`` bytes are ordinary ones."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = count * itemsize
    if nbytes < min_bytes or _MADVISE is None:
        return torch.empty(count, dtype=dtype)
    span = (nbytes + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    raw = torch.empty(span + _HUGE_PAGE, dtype=torch.uint8)
    address = raw.data_ptr()
    offset = -address % _HUGE_PAGE
    _MADVISE(address + offset, span, _MADV_HUGEPAGE)
    return raw[offset : offset + nbytes].view(dtype)


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(tensor)``, with huge pages advised for a large CPU result (see
    module docstring). The advice is a hint: where it is refused, nothing changes."""
    out = torch.empty_like(tensor)
    nbytes = out.nbytes
    if nbytes >= HUGE_PAGE_MIN_BYTES and _MADVISE is not None and out.is_cpu:
        address = out.data_ptr()
        start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
        end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            _MADVISE(start, end - start, _MADV_HUGEPAGE)
    return out


def zeros_buffer(count: int, like: torch.Tensor) -> torch.Tensor:
    """A flat zeroed buffer of ``count`` elements of ``like``'s dtype on ``like``'s device,
    for collectives to reduce step after step: on the CPU, from
    :data:`BUFFER_HUGE_MIN_BYTES` on, on huge pages (see module docstring)."""
    if not cuda_support.is_cuda(like) and like.device.type == "cpu":
        return empty_huge(count, like.dtype, BUFFER_HUGE_MIN_BYTES).zero_()
    return torch.zeros(count, dtype=like.dtype, device=like.device)
