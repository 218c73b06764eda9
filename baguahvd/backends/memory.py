"""Fresh CPU tensors for the results of collectives.

An out-of-place result is new memory that the collective writes whole, and for a large
tensor the first touch of its pages costs as much as the reduction: the kernel faults in
and zeroes one 4 KB page at a time (a fresh 64 MB output on two ranks over shared memory:
an allreduce into it took 40 ms, into reused memory 12 ms). :func:`empty_like` asks Linux
for transparent huge pages on the 2 MB-aligned part of a large allocation, as NumPy does
for its own arrays of 4 MB and more, so the same memory arrives in 512 times fewer faults.
The memory stays the caller's ordinary tensor; nothing is pooled or shared.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

import torch

HUGE_PAGE_MIN_BYTES = 4 << 20
"""Allocations from this size on are advised to use huge pages (NumPy's threshold)."""

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
