"""Gradient allreduce, bucketed (Bagua's GradientAllReduce; DDP-equivalent).

Steps per training step: as backward produces gradients, each complete bucket (in order) is
copied into its flat buffer and allreduced in place, Average (or Sum); ``step()`` waits and
writes the results back into ``p.grad``. Hierarchical: node average, allreduce among node
leaders, node broadcast.
"""

from __future__ import annotations

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
from baguahvd.torch.mpi_ops import Average, Sum, allreduce_


class GradientAllReduceAlgorithm(Algorithm):
    """Averages (or sums) gradients with full-precision allreduce.

    Args:
        hierarchical: reduce inside each node, allreduce among node leaders, broadcast
            inside the node.
        average: True for the mean of the gradients, False for their sum.
    """

    name = "gradient_allreduce"

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        check_bool("hierarchical", hierarchical)
        check_bool("average", average)
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        return _GradientAllReduceImpl(self, context)


class _GradientAllReduceImpl(GradientAlgorithmImpl):
    algorithm: GradientAllReduceAlgorithm

    def __init__(self, algorithm: GradientAllReduceAlgorithm, context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.hierarchy = Hierarchy(context.process_set) if algorithm.hierarchical else None

    def communicate(self, bucket: Bucket) -> None:
        op = Average if self.algorithm.average else Sum
        name = bucket_name(self.algorithm, bucket)
        if self.hierarchy is None:
            allreduce_(bucket.flat, name=name, op=op, process_set=self.context.process_set)
            return

        def among_leaders(flat: object, leaders: ProcessSet) -> None:
            allreduce_(bucket.flat, name=name, op=Average, process_set=leaders)
            if not self.algorithm.average:
                bucket.flat.mul_(self.context.size)

        self.hierarchy.run(bucket.flat, name, among_leaders)
