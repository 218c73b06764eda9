"""Decentralized SGD: ranks average their weights with peers instead of their gradients.

D-PSGD (Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?",
arXiv 1705.09056), as Bagua's ``DecentralizedAlgorithm`` runs it. Every rank keeps its own
model; gradients are never communicated. On a communicating step (every
``communication_interval`` optimizer steps, counting from step 0):

1. at the first gradient hook of the step (the weights are still those the forward pass
   used), copy all trainable weights into one flat buffer per dtype, the *peer weight*;
2. on a worker thread, overlapping the rest of backward, mix the peer weight with other
   ranks: ``"all"`` averages it over every rank (allreduce); ``"shift_one"`` exchanges it
   with one peer and keeps the pairwise mean, the peer rotating on each communication;
3. before the optimizer step, wait and write the mixed weights into the parameters;
4. the optimizer step applies the local gradient, computed at the pre-mixing weights, to
   the mixed weights: ``x_{t+1} = mix(x_t) - lr * g(x_t)``.

Other steps are plain local steps. Hierarchical mode averages inside each node first,
gossips among the node leaders and broadcasts the result inside the node, so nodes (not
ranks) are the gossip participants.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from baguahvd.kernels import average_
from baguahvd.runtime.process_sets import ProcessSet
from baguahvd.torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    Worker,
    bucket_name,
    check_bool,
    check_int,
)
from baguahvd.torch.algorithms.buckets import split_into_buckets
from baguahvd.torch.algorithms.hierarchy import optional_hierarchy
from baguahvd.torch.algorithms.primitives import (
    KERNEL_DTYPES,
    Exchange,
    among_participants,
    broadcast_weights,
    set_size_and_rank,
)
from baguahvd.torch.mpi_ops import Average, allreduce_, alltoall

PEER_SELECTION_MODES = ("all", "shift_one")

_ONE_BUCKET_BYTES = 1 << 62
"""A bucket size no model reaches: one bucket per dtype."""


def shift_one_peer(rank: int, size: int, shift: int) -> int:
    """The peer of ``rank`` on the ``shift``-th communication of ``"shift_one"``.

    The ranks split into halves ``[0, h)`` and ``[h, 2h)``; a perfect matching between the
    halves rotates by one on every communication:
    ``r < h -> h + (r + shift) mod h`` and ``r >= h -> (r - h - shift) mod h``.

    Args:
        rank: index among the participants.
        size: number of participants, even.
        shift: communications done before this one.
    """
    half = size // 2
    if rank < half:
        return half + (rank + shift) % half
    return (rank - half - shift) % half


class DecentralizedAlgorithm(Algorithm):
    """Decentralized SGD with full-precision weight averaging (D-PSGD, arXiv 1705.09056).

    The steps are listed in :mod:`baguahvd.torch.algorithms.decentralized`. The models of the
    ranks differ during training (except right after an ``"all"`` averaging); evaluate per
    rank or average once explicitly at the end.

    Args:
        hierarchical: average inside each node, gossip among node leaders, broadcast inside
            the node (Bagua's default). Needs the global process set.
        peer_selection_mode: ``"all"`` averages with every participant; ``"shift_one"``
            averages with one peer from the other half of the participants, rotating on
            each communication. ``"shift_one"`` needs an even number of participants
            (ranks, or nodes when hierarchical).
        communication_interval: communicate every this many optimizer steps (steps 0, k,
            2k, ...); the steps in between are local SGD steps.

    Raises:
        ValueError: a hyperparameter has a bad type or value.
    """

    name: ClassVar[str] = "decentralized"

    def __init__(
        self,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        communication_interval: int = 1,
    ) -> None:
        check_bool("hierarchical", hierarchical)
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"peer_selection_mode must be one of {', '.join(map(repr, PEER_SELECTION_MODES))}"
                f", got {peer_selection_mode!r}."
            )
        check_int("communication_interval", communication_interval, 1)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        """Checks the participant count, broadcasts rank 0's weights, returns the hooks.

        Raises:
            ValueError: ``"shift_one"`` with an odd number of participants, or
                ``hierarchical=True`` with a process set other than the global one.
        """
        return _DecentralizedImpl(self, context)


class _DecentralizedImpl(AlgorithmImpl):
    algorithm: DecentralizedAlgorithm

    def __init__(self, algorithm: DecentralizedAlgorithm, context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.hierarchy = optional_hierarchy(context.process_set, algorithm.hierarchical)
        if algorithm.peer_selection_mode == "shift_one":
            self._check_even(context)
        self.buckets = split_into_buckets(context.parameters, _ONE_BUCKET_BYTES)
        broadcast_weights(self.buckets, context.process_set, f"bagua.{algorithm.name}")
        # The mixing result; it starts as a snapshot of the weights the forward pass used.
        self.peer_weights = [torch.empty_like(bucket.flat) for bucket in self.buckets]
        self.communications = 0
        """Exchanges done so far: the rotation of ``"shift_one"``."""
        self._launched = False
        self._synchronized_step = -1
        self._worker = Worker(algorithm)

    def _check_even(self, context: AlgorithmContext) -> None:
        if self.hierarchy is not None:
            count = self.hierarchy.node_count
            what = "nodes (hierarchical=True gossips between nodes)"
        else:
            count, what = context.size, "ranks"
        if count % 2:
            raise ValueError(
                f'decentralized peer_selection_mode="shift_one" pairs the participants and '
                f"needs an even number of them, but there are {count} {what}; use "
                f'hierarchical=False, peer_selection_mode="all", or an even count.'
            )

    def _communicates(self) -> bool:
        return (
            self.step_id % self.algorithm.communication_interval == 0
            and self._synchronized_step != self.step_id
        )

    def on_backward(self, p: torch.Tensor) -> None:
        if not self._launched and self._communicates():
            self._launch()

    def _launch(self) -> None:
        self._launched = True
        for bucket, peer in zip(self.buckets, self.peer_weights):
            bucket.gather_weights(peer)
        shift = self.communications
        self.communications += 1
        self._worker.submit(
            lambda: self._exchange(shift), self.peer_weights[0] if self.peer_weights else None
        )

    def synchronize(self) -> None:
        if not self._communicates():
            return
        if not self._launched:
            self._launch()
        try:
            self._worker.wait()
        finally:
            self._launched = False
            self._synchronized_step = self.step_id
        for bucket, peer in zip(self.buckets, self.peer_weights):
            bucket.scatter_weights(peer)

    def _exchange(self, shift: int) -> None:
        for bucket, peer in zip(self.buckets, self.peer_weights):
            name = bucket_name(self.algorithm, bucket)
            among_participants(
                peer, name, self.context.process_set, self.hierarchy, self._mixer(name, shift)
            )

    def _mixer(self, name: str, shift: int) -> Exchange:
        def mix(flat: torch.Tensor, participants: ProcessSet) -> None:
            self._mix(flat, name, participants, shift)

        return mix

    def _mix(self, flat: torch.Tensor, name: str, process_set: ProcessSet, shift: int) -> None:
        size, rank = set_size_and_rank(process_set)
        if size == 1:
            return
        if self.algorithm.peer_selection_mode == "all":
            allreduce_(flat, name=f"{name}.all", op=Average, process_set=process_set)
            return
        splits = [0] * size
        splits[shift_one_peer(rank, size, shift)] = 1
        received, _ = alltoall(
            flat.view(1, -1), splits=splits, name=f"{name}.shift_one", process_set=process_set
        )
        other = received.view(-1)
        if flat.dtype in KERNEL_DTYPES:
            average_(flat, other)
        else:
            flat.add_(other).div_(2)

    def close(self) -> None:
        self._worker.close()
