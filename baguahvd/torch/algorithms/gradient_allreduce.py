"""Gradient allreduce, bucketed (Bagua's GradientAllReduce; DDP-equivalent).

Steps per training step: as backward produces gradients, each complete bucket (in order) is
copied into its flat buffer and allreduced in place, Average (or Sum); ``step()`` waits and
writes the results back into ``p.grad``. Hierarchical: node average, allreduce among node
leaders, node broadcast.
"""

from __future__ import annotations

from typing import Any

from baguahvd.runtime.runtime import runtime
from baguahvd.torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    GradientAlgorithmImpl,
    bucket_name,
    check_bool,
)
from baguahvd.torch.algorithms.bucket_tuning import BucketTuner
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
        config = runtime.config
        self.bucket_tuner = (
            BucketTuner(
                context.bucket_bytes, context.process_set, config,
                lambda: runtime.require_engine().autotuning,
                f"bagua.{algorithm.name}:{context.parameters[0][0]}",
            )
            if config is not None and config.autotune and context.size > 1
            and context.parameters
            else None
        )
        """HOROVOD_AUTOTUNE: the bucket size's tuner (:mod:`.bucket_tuning`)."""

    def post_step(self) -> None:
        super().post_step()
        if self.bucket_tuner is not None:
            bucket_bytes = self.bucket_tuner.after_step(self.step_id)
            if bucket_bytes is not None:
                self.rebucket(bucket_bytes)

    def close(self) -> None:
        super().close()
        if self.bucket_tuner is not None:
            self.bucket_tuner.close()

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

