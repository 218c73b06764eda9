"""Large allreduces as a ring of point-to-point exchanges: a reduce-scatter, then an allgather.

Open MPI's own ``MPI_Allreduce`` of a large message on one machine runs at about half the
speed of this ring (``benchmarks/results/shared_memory/NOTES.md``), and
out of place it first copies the whole input into the output. Here every byte crosses to
the next rank once per phase as one large message (a single copy through shared memory),
each rank reduces with torch's vectorized kernels, and an out-of-place reduction receives
straight into the output: no copy of the input, no scratch memory.

The protocol, for ``n`` members, rank ``r`` sending to ``r + 1`` and receiving from ``r - 1``
(mod ``n``), the flat tensor cut into ``n`` blocks:

1. reduce-scatter, steps ``s = 0 .. n-2``: send block ``r - s`` (this rank's input for
   ``s = 0``, the partial result received and reduced at step ``s - 1`` after), receive
   block ``r - s - 1`` and reduce it with this rank's input block. After ``n - 1`` steps
   block ``r + 1`` holds the reduction of every member's block.
2. allgather, steps ``s = 0 .. n-2``: send block ``r + 1 - s``, receive block ``r - s``.

Each block is reduced along one path and then copied, so every member ends with the same
bits. An out-of-place reduction receives each block into the output block that it reduces
into (no block is received twice in the first phase, and the one never received there,
``r``, comes in the second); in place, the received block goes through one scratch block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from baguahvd.common.ops import ReduceOp

RING_MIN_BYTES = 1 << 20
"""Out-of-place messages from this size on take the ring. Below it Open MPI's
latency-bound algorithms win: at 256 KB on two ranks over shared memory the two are even
out of place, and Open MPI is 1.5x faster in place."""

RING_MIN_BYTES_IN_PLACE = 32 << 20
"""In-place messages from this size on take the ring. Up to 16 MB Open MPI's in-place
algorithm is as fast (4-8 MB: even; 16 MB: 0.8-1.2x, within the noise), from 32 MB on the
ring is twice as fast."""

SEGMENT_BYTES = 4 << 20
"""The reduce-scatter exchanges blocks in pieces of this size, each reduced while it is
still in the cache (and, in place, received through a scratch piece of this size)."""

_TAG = 0x7269
"""Tag of the ring's messages, apart from anything else sent on the communicator."""

_REDUCE: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.PRODUCT: torch.mul,
}


def takes_ring(op: ReduceOp, nbytes: int, in_place: bool) -> bool:
    """Whether an allreduce of ``nbytes`` with ``op`` goes through the ring."""
    return op in _REDUCE and nbytes >= (RING_MIN_BYTES_IN_PLACE if in_place else RING_MIN_BYTES)


def _bounds(count: int, size: int) -> list[int]:
    return [count * block // size for block in range(size + 1)]


def allreduce(
    comm: Any, flat_in: torch.Tensor, flat_out: torch.Tensor, op: ReduceOp,
    scale: Callable[[torch.Tensor], None] | None = None,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Reduces the one-dimensional contiguous ``flat_in`` of every member of the mpi4py
    communicator ``comm`` into ``flat_out`` (which may be ``flat_in``) with ``op``.

    ``scale``, an element-wise function applied in place, is applied to each piece of the
    block this rank completes right after its last reduction, while it is in cache; the
    allgather then hands the scaled values to the others."""
    reduce = _REDUCE[op]
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    bounds = _bounds(flat_out.numel(), size)
    ins = [flat_in[bounds[b]:bounds[b + 1]] for b in range(size)]
    outs = [flat_out[bounds[b]:bounds[b + 1]] for b in range(size)]
    segment = max(1, segment_bytes // flat_out.element_size())
    in_place = flat_in.data_ptr() == flat_out.data_ptr()
    widest = min(segment, max(block.numel() for block in outs))
    scratch = flat_out.new_empty(widest) if in_place else None
    last = size - 2
    for step in range(size - 1):
        sent, received = (rank - step) % size, (rank - step - 1) % size
        source = ins[sent] if step == 0 else outs[sent]
        target, own = outs[received], ins[received]
        for start in range(0, target.numel(), segment):
            part = target[start:start + segment]
            buffer = part if scratch is None else scratch[: part.numel()]
            comm.Sendrecv(
                source[start:start + segment].numpy(), right, _TAG, buffer.numpy(), left, _TAG
            )
            reduce(buffer, own[start:start + segment], out=part)
            if scale is not None and step == last:
                scale(part)
    for step in range(size - 1):
        sent, received = (rank + 1 - step) % size, (rank - step) % size
        comm.Sendrecv(outs[sent].numpy(), right, _TAG, outs[received].numpy(), left, _TAG)
