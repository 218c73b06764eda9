"""Communication primitives the algorithms are built from.

- :func:`centralized_reduce`: every participant ends with the mean (or sum) of a flat
  buffer, in full precision or compressed, flat over the process set or hierarchical
  (node average, reduce among node leaders, node broadcast);
- :func:`among_participants`: runs an algorithm's own exchange (gossip, ring) on the
  process set, or among the node leaders between a node average and a node broadcast;
- :class:`MinMaxUInt8`: ByteGrad's compressed scatter-gather average;
- :func:`broadcast_weights`: every rank starts from the first rank's model.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence

import torch

from baguahvd.kernels import (
    DTYPE_SUFFIXES,
    compress_minmax_uint8,
    decompress_minmax_uint8,
    decompress_reduce_minmax_uint8,
)
from baguahvd.runtime.process_sets import ProcessSet
from baguahvd.torch.algorithms.buckets import Bucket
from baguahvd.torch.algorithms.hierarchy import Hierarchy
from baguahvd.torch.mpi_ops import Average, Sum, allgather, allreduce_, alltoall, broadcast_

KERNEL_DTYPES: tuple[torch.dtype, ...] = tuple(DTYPE_SUFFIXES)
"""dtypes the elementwise and compression kernels accept."""

Exchange = Callable[[torch.Tensor, ProcessSet], None]
"""``body(flat, participants)``: an in-place collective on ``flat`` among ``participants``."""


def check_compressible(
    algorithm: str, parameters: Iterable[tuple[str, torch.Tensor]], what: str
) -> None:
    """Raises ``ValueError`` naming the first parameter whose dtype the compression kernels
    do not accept; ``what`` says what the algorithm compresses (gradients, weights...)."""
    names = "/".join(str(dtype).replace("torch.", "") for dtype in KERNEL_DTYPES)
    for name, p in parameters:
        if p.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"{algorithm} compresses {names} {what}; parameter {name} is {p.dtype}."
            )


def set_size_and_rank(process_set: ProcessSet) -> tuple[int, int]:
    """``(size, rank)`` of this process in a registered process set."""
    return int(process_set.size() or 1), int(process_set.rank() or 0)


class Compressor(abc.ABC):
    """A compressed replacement for a full-precision allreduce of a flat buffer."""

    @abc.abstractmethod
    def reduce(
        self, flat: torch.Tensor, name: str, process_set: ProcessSet, average: bool
    ) -> None:
        """Leaves the mean (``average``) or sum over ``process_set`` in ``flat``; every
        member ends with the same bits."""


class MinMaxUInt8(Compressor):
    """ByteGrad's scatter-gather with 8-bit MinMaxUInt8 chunks, per flat buffer of length L
    (padded to a multiple of the n members), chunk j belonging to member j:

    1. compress the buffer into n chunks, each with its own min/max;
    2. alltoall the compressed chunks, so each member receives every copy of its chunk;
    3. decompress them and reduce (mean or sum, fp32 accumulation) into its chunk;
    4. compress the reduced chunk once more and allgather it;
    5. decompress every member's reduced chunk into the buffer.
    """

    def reduce(
        self, flat: torch.Tensor, name: str, process_set: ProcessSet, average: bool
    ) -> None:
        compressed_average(flat, name, process_set, int(process_set.size() or 1), average)


def compressed_average(
    flat: torch.Tensor, name: str, process_set: ProcessSet, group_size: int, average: bool
) -> None:
    """Steps 1-5 of :class:`MinMaxUInt8` on ``flat`` among ``group_size`` members."""
    if flat.numel() % group_size:
        padded = flat.new_zeros(-(-flat.numel() // group_size) * group_size)
        padded[: flat.numel()].copy_(flat)
        compressed_average(padded, name, process_set, group_size, average)
        flat.copy_(padded[: flat.numel()])
        return
    numel = flat.numel()
    compressed = compress_minmax_uint8(flat, group_size)
    received = alltoall(compressed, name=f"{name}.alltoall", process_set=process_set)
    reduced = decompress_reduce_minmax_uint8(
        received, group_size, numel, flat.dtype, average=average
    )
    mine = compress_minmax_uint8(reduced, 1)
    gathered = allgather(mine, name=f"{name}.allgather", process_set=process_set)
    decompress_minmax_uint8(gathered, group_size, numel, flat.dtype, out=flat)


def among_participants(
    flat: torch.Tensor,
    name: str,
    process_set: ProcessSet,
    hierarchy: Hierarchy | None,
    body: Exchange,
) -> None:
    """Runs ``body`` on ``flat`` among the process set's ranks, or, with a ``hierarchy``,
    among the node leaders after a node average and before a node broadcast."""
    if hierarchy is None:
        body(flat, process_set)
    else:
        hierarchy.run(flat, name, body)


def centralized_reduce(
    flat: torch.Tensor,
    name: str,
    process_set: ProcessSet,
    hierarchy: Hierarchy | None = None,
    average: bool = True,
    compressor: Compressor | None = None,
) -> None:
    """Leaves the mean (``average``) or the sum of ``flat`` over the process set in
    ``flat`` on every member.

    Args:
        flat: the buffer, reduced in place.
        name: the collective's name (the same on every rank).
        process_set: the ranks that reduce.
        hierarchy: reduce hierarchically (node average, reduce among node leaders, node
            broadcast); the leaders average, and a sum is the mean times the set size.
        average: mean (True) or sum (False).
        compressor: ``None`` for a full-precision allreduce, or the compressed exchange
            that replaces it (among the leaders when hierarchical).
    """

    def reduce(buffer: torch.Tensor, participants: ProcessSet, mean: bool) -> None:
        if compressor is None:
            op = Average if mean else Sum
            allreduce_(buffer, name=name, op=op, process_set=participants)
        else:
            compressor.reduce(buffer, name, participants, mean)

    if hierarchy is None:
        reduce(flat, process_set, average)
        return
    size = int(process_set.size() or 1)

    def among_leaders(buffer: torch.Tensor, leaders: ProcessSet) -> None:
        reduce(buffer, leaders, True)
        if not average:
            buffer.mul_(size)

    hierarchy.run(flat, name, among_leaders)


def broadcast_weights(
    buckets: Sequence[Bucket], process_set: ProcessSet, prefix: str
) -> None:
    """Overwrites every rank's parameters with those of the process set's first rank.

    Decentralized algorithms need every rank to start from the same model: the replicas of
    the low-precision variant, in particular, are only consistent if they start equal.
    """
    ranks = process_set.ranks or [0]
    for bucket in buckets:
        bucket.gather_weights()
        broadcast_(
            bucket.flat, ranks[0], name=f"{prefix}.init.bucket{bucket.index}",
            process_set=process_set,
        )
        bucket.scatter_weights()
