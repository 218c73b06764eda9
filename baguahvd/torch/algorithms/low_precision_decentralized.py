"""Low-precision decentralized SGD: ring gossip of 8-bit compressed model differences.

Tang et al., "Communication Compression for Decentralized Training" (arXiv 1803.06443), as
Bagua's ``LowPrecisionDecentralizedAlgorithm`` runs it. The ranks form a ring; rank r's
neighbours are r-1 and r+1 (mod n). For every bucket each rank keeps three *replicas*,
seeded from rank 0's broadcast weights: ``w`` (the public copy of its own model, which
every neighbour also holds) and ``l``, ``r`` (its copies of the left and right neighbours'
public models). After the optimizer step of a communicating step, blocking, per bucket:

1. ``x`` = the bucket's weights after the local step;
2. ``d = (x - w) + ((l - w) + (r - w)) / 3``: the local update plus the gossip correction
   with mixing weights 1/3 for self, left and right;
3. compress ``d`` with MinMaxUInt8 as a single chunk (one min/max for the whole bucket);
4. send it to both neighbours and receive theirs (one alltoall);
5. ``l += Q(d_left)``, ``r += Q(d_right)``, ``w += Q(d)``, and the weights become ``w``.

Messages are compressed *differences*, never models, and every holder of a replica applies
the same ``Q(d)``, so rank r's ``l`` stays bit-identical to rank r-1's ``w``.

Hierarchical mode averages the post-step weights inside each node, runs steps 2-5 on the
ring of node leaders and broadcasts the result inside the node. On a single node the ring
has one member, whose neighbours are itself: nothing leaves the node and the step reduces
to ``x = w + Q(mean_node(x) - w)``, a quantized node average (implemented, not refused).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from baguahvd.kernels import (
    compress_minmax_uint8,
    decompress_add_minmax_uint8_,
    lowprec_decentralized_diff_,
)
from baguahvd.runtime.process_sets import ProcessSet
from baguahvd.torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    bucket_name,
    check_bool,
    check_int,
)
from baguahvd.torch.algorithms.buckets import split_into_buckets
from baguahvd.torch.algorithms.hierarchy import optional_hierarchy
from baguahvd.torch.algorithms.primitives import (
    Exchange,
    among_participants,
    broadcast_weights,
    check_compressible,
    set_size_and_rank,
)
from baguahvd.torch.mpi_ops import alltoall


@dataclasses.dataclass
class Replicas:
    """The public models one rank tracks for one bucket (flat, like the bucket)."""

    weight: torch.Tensor
    """This rank's public model: what its neighbours hold as their ``left``/``right``."""
    left: torch.Tensor
    """Copy of the left neighbour's ``weight``."""
    right: torch.Tensor
    """Copy of the right neighbour's ``weight``."""


class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Ring gossip of compressed weight differences (arXiv 1803.06443).

    The steps are listed in :mod:`baguahvd.torch.algorithms.low_precision_decentralized`.
    Parameters must be float32, float16 or bfloat16. The ranks' models differ during
    training; the replicas are seeded when the optimizer is built, so the weights must not
    be changed behind the optimizer's back afterwards.

    Args:
        hierarchical: full-precision average inside each node, compressed ring among the
            node leaders, broadcast inside the node (Bagua's default). On one node this is
            a quantized node average. Needs the global process set.
        communication_interval: communicate after every this many optimizer steps (steps
            0, k, 2k, ...); the steps in between are local SGD steps.

    Raises:
        ValueError: a hyperparameter has a bad type or value.
    """

    name: ClassVar[str] = "low_precision_decentralized"

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1) -> None:
        check_bool("hierarchical", hierarchical)
        check_int("communication_interval", communication_interval, 1)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        """Broadcasts rank 0's weights, seeds the replicas from them, returns the hooks.

        Raises:
            ValueError: a parameter of an unsupported dtype, or ``hierarchical=True`` with a
                process set other than the global one.
        """
        check_compressible(self.name, context.parameters, "weights")
        return _LowPrecisionDecentralizedImpl(self, context)


class _LowPrecisionDecentralizedImpl(AlgorithmImpl):
    algorithm: LowPrecisionDecentralizedAlgorithm

    def __init__(
        self, algorithm: LowPrecisionDecentralizedAlgorithm, context: AlgorithmContext
    ) -> None:
        super().__init__(algorithm, context)
        self.hierarchy = optional_hierarchy(context.process_set, algorithm.hierarchical)
        self.buckets = split_into_buckets(context.parameters, context.bucket_bytes)
        broadcast_weights(self.buckets, context.process_set, f"bagua.{algorithm.name}")
        # Only ranks that run the ring (all, or the node leaders) track replicas.
        runs_ring = self.hierarchy is None or self.hierarchy.is_leader
        self.replicas: list[Replicas] = (
            [
                Replicas(b.flat.clone(), b.flat.clone(), b.flat.clone())
                for b in self.buckets
            ]
            if runs_ring
            else []
        )

    def post_step(self) -> None:
        if self.step_id % self.algorithm.communication_interval == 0:
            self._communicate()
        super().post_step()

    def _communicate(self) -> None:
        for index, bucket in enumerate(self.buckets):
            x = bucket.gather_weights()
            name = bucket_name(self.algorithm, bucket)
            among_participants(
                x, name, self.context.process_set, self.hierarchy, self._ring(index, name)
            )
            bucket.scatter_weights(x)

    def _ring(self, index: int, name: str) -> Exchange:
        def ring(flat: torch.Tensor, participants: ProcessSet) -> None:
            self._ring_step(flat, self.replicas[index], name, participants)

        return ring

    def _ring_step(
        self, x: torch.Tensor, replicas: Replicas, name: str, process_set: ProcessSet
    ) -> None:
        """Steps 2-5 of the module docstring; ``x`` ends as the new weights."""
        size, rank = set_size_and_rank(process_set)
        lowprec_decentralized_diff_(x, replicas.weight, replicas.left, replicas.right)
        own = compress_minmax_uint8(x, 1)
        from_left, from_right = self._exchange(own, name, process_set, size, rank)
        decompress_add_minmax_uint8_(replicas.left, from_left)
        decompress_add_minmax_uint8_(replicas.right, from_right)
        decompress_add_minmax_uint8_(replicas.weight, own)
        x.copy_(replicas.weight)

    @staticmethod
    def _exchange(
        own: torch.Tensor, name: str, process_set: ProcessSet, size: int, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sends ``own`` to both ring neighbours; returns what the left and right sent."""
        if size == 1:
            # A ring of one: both neighbours are this rank.
            return own, own
        left, right = (rank - 1) % size, (rank + 1) % size
        splits = [0] * size
        splits[left] = 1
        splits[right] = 1
        # With two ranks left == right: the one peer's message is received once and
        # applied to both neighbour replicas (Bagua sends it twice).
        rows = own.view(1, -1).expand(sum(splits), -1).contiguous()
        received, _ = alltoall(
            rows, splits=splits, name=f"{name}.ring", process_set=process_set
        )
        if size == 2:
            return received[0], received[0]
        # Received rows come in rank order.
        if left < right:
            return received[0], received[1]
        return received[1], received[0]
