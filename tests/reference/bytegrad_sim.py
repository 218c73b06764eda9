"""Single-process simulation of ByteGrad over N ranks, built on the torch kernels (the
oracle of the compressor): what every rank must hold after one compressed average."""

from __future__ import annotations

import torch

from baguahvd.kernels import (
    compress_minmax_uint8,
    decompress_minmax_uint8,
    decompress_reduce_minmax_uint8,
    minmax_uint8_layout,
)


def simulate_bytegrad(flats: list[torch.Tensor], average: bool = True) -> torch.Tensor:
    """The result of ByteGrad's scatter-gather on ``flats[r]`` (rank r's padded bucket)."""
    n = len(flats)
    numel = flats[0].numel()
    dtype = flats[0].dtype
    slot = minmax_uint8_layout(numel, n).total_bytes // n
    compressed = [compress_minmax_uint8(flat, n) for flat in flats]
    reduced_slots = []
    for r in range(n):
        # Rank r receives slot r of every rank's buffer, in rank order.
        received = torch.cat([buf[r * slot : (r + 1) * slot] for buf in compressed])
        reduced = decompress_reduce_minmax_uint8(received, n, numel, dtype, average=average)
        reduced_slots.append(compress_minmax_uint8(reduced, 1))
    return decompress_minmax_uint8(torch.cat(reduced_slots), n, numel, dtype)
