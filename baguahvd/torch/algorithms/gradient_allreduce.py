"""Gradient allreduce, bucketed (Bagua's GradientAllReduce; DDP-equivalent).

Steps per training step: as backward produces gradients, each complete bucket (in order) is
copied into its flat buffer and allreduced in place, Average (or Sum); ``step()`` waits and
writes the results back into ``p.grad``. Hierarchical: node average, allreduce among node
leaders, node broadcast.
"""

from __future__ import annotations

from typing import Any

from baguahvd.torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    GradientAlgorithmImpl,
    bucket_name,
    check_bool,
)
from baguahvd.torch.algorithms.buckets import Bucket
from baguahvd.torch.algorithms.hierarchy import optional_hierarchy
from baguahvd.torch.algorithms.primitives import Compressor, centralized_reduce


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
        return CentralizedReduceImpl(self, context)


class CentralizedReduceImpl(GradientAlgorithmImpl):
    """Each bucket reduced by :func:`centralized_reduce` with the algorithm's ``hierarchical``
    and ``average`` settings; subclasses choose a compressor."""

    algorithm: GradientAllReduceAlgorithm

    def __init__(self, algorithm: Any, context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.hierarchy = optional_hierarchy(context.process_set, algorithm.hierarchical)

    def compressor(self) -> Compressor | None:
        """What the bucket travels as between ranks: full precision by default."""
        return None

    def communicate(self, bucket: Bucket) -> None:
        centralized_reduce(
            bucket.flat,
            bucket_name(self.algorithm, bucket),
            self.context.process_set,
            self.hierarchy,
            average=self.algorithm.average,
            compressor=self.compressor(),
        )

