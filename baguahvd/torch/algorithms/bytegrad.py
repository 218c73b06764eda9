"""ByteGrad: gradients averaged with 8-bit MinMaxUInt8 compression (Bagua).

Per bucket of length L (padded to a multiple of the n ranks), with chunk j belonging to
rank j:

1. compress the bucket into n chunks, each with its own min/max;
2. alltoall the compressed chunks, so this rank receives every rank's copy of its chunk;
3. decompress them and reduce (mean or sum, fp32 accumulation) into this rank's chunk;
4. compress the reduced chunk once more and allgather it;
5. decompress every rank's reduced chunk into the bucket.

Every rank ends with bit-identical gradients, having sent about a quarter of fp32's bytes.
Hierarchical: the node average is full precision; the compressed exchange runs among node
leaders; the result is broadcast inside the node.
"""

from __future__ import annotations

import torch

from baguahvd.kernels import (
    compress_minmax_uint8,
    decompress_minmax_uint8,
    decompress_reduce_minmax_uint8,
)
from baguahvd.runtime.process_sets import ProcessSet
from baguahvd.torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    GradientAlgorithmImpl,
    bucket_name,
    check_bool,
)
from baguahvd.torch.algorithms.buckets import Bucket
from baguahvd.torch.algorithms.hierarchy import Hierarchy
from baguahvd.torch.mpi_ops import allgather, alltoall

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def compressed_average(
    flat: torch.Tensor, name: str, process_set: ProcessSet, group_size: int, average: bool
) -> None:
    """Steps 1-5 of the module docstring on ``flat``, in place."""
    if flat.numel() % group_size:
        padded = torch.zeros(-(-flat.numel() // group_size) * group_size, dtype=flat.dtype)
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


class ByteGradAlgorithm(Algorithm):
    """8-bit compressed gradient averaging.

    Args:
        hierarchical: full-precision node average, compressed exchange among node leaders
            (Bagua's default: True).
        average: mean (True) or sum (False) of the gradients.
    """

    name = "bytegrad"

    def __init__(self, hierarchical: bool = True, average: bool = True) -> None:
        check_bool("hierarchical", hierarchical)
        check_bool("average", average)
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        for name, p in context.parameters:
            if p.dtype not in _SUPPORTED:
                raise ValueError(
                    f"bytegrad compresses float32/float16/bfloat16 gradients; parameter "
                    f"{name} is {p.dtype}."
                )
        return _ByteGradImpl(self, context)


class _ByteGradImpl(GradientAlgorithmImpl):
    algorithm: ByteGradAlgorithm
    alignment_by_size = True

    def __init__(self, algorithm: ByteGradAlgorithm, context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.hierarchy = Hierarchy(context.process_set) if algorithm.hierarchical else None

    def communicate(self, bucket: Bucket) -> None:
        name = bucket_name(self.algorithm, bucket)
        average = self.algorithm.average
        if self.hierarchy is None:
            compressed_average(
                bucket.flat, name, self.context.process_set, self.context.size, average
            )
            return
        hierarchy = self.hierarchy

        def among_leaders(flat: torch.Tensor, leaders: ProcessSet) -> None:
            compressed_average(flat, name, leaders, hierarchy.node_count, True)
            if not average:
                flat.mul_(self.context.size)

        hierarchy.run(bucket.flat, name, among_leaders)
