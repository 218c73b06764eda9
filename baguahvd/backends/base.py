"""The interface every communicator implements, with uniform signatures.

A communicator spans the members of one process set. Buffers are torch tensors; the engine
has already checked that shapes, dtypes and counts agree across ranks, so implementations
move bytes and reduce without re-validating. Counts are in elements of the given tensors.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from baguahvd.common.ops import ReduceOp


class Communicator(abc.ABC):
    """Collectives over a fixed group of ranks."""

    rank: int
    """This process's index in the group."""
    size: int
    """Number of ranks in the group."""

    @abc.abstractmethod
    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        """Reduces ``tensor_in`` element-wise over the group into ``tensor_out``.

        ``op`` is SUM, MIN, MAX or PRODUCT (AVERAGE and ADASUM are built on top by the engine).
        ``tensor_in`` may be ``tensor_out`` for an in-place reduction.
        """

    @abc.abstractmethod
    def allgather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, counts: Sequence[int]
    ) -> None:
        """Concatenates every rank's ``tensor_in`` (``counts[r]`` elements from rank r) into
        ``tensor_out`` in rank order."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Overwrites ``tensor`` on every rank with the group-rank ``root``'s data."""

    @abc.abstractmethod
    def alltoall(
        self,
        tensor_in: torch.Tensor,
        send_counts: Sequence[int],
        tensor_out: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> None:
        """Sends ``send_counts[r]`` consecutive elements of ``tensor_in`` to rank r and
        receives ``recv_counts[r]`` elements from rank r into ``tensor_out``, in rank order."""

    @abc.abstractmethod
    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor,
        counts: Sequence[int],
        op: ReduceOp,
    ) -> None:
        """Reduces ``tensor_in`` over the group and leaves block r (``counts[r]`` elements, in
        order) on rank r in ``tensor_out``."""

    @abc.abstractmethod
    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        """Sends ``tensor_out`` to group rank ``peer`` and receives the same number of
        elements from it into ``tensor_in``."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Returns once every rank of the group has called it."""

    def free(self) -> None:  # noqa: B027 - optional hook
        """Releases the underlying resources."""


class SelfCommunicator(Communicator):
    """The group of one: every collective is a copy. Used for single-member process sets,
    so one code path serves every group size."""

    rank = 0
    size = 1

    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        if tensor_out is not tensor_in:
            tensor_out.copy_(tensor_in)

    def allgather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, counts: Sequence[int]
    ) -> None:
        tensor_out.view(-1)[: counts[0]].copy_(tensor_in.reshape(-1)[: counts[0]])

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        return None

    def alltoall(
        self,
        tensor_in: torch.Tensor,
        send_counts: Sequence[int],
        tensor_out: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> None:
        tensor_out.view(-1)[: recv_counts[0]].copy_(tensor_in.reshape(-1)[: send_counts[0]])

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor,
        counts: Sequence[int],
        op: ReduceOp,
    ) -> None:
        tensor_out.view(-1)[: counts[0]].copy_(tensor_in.reshape(-1)[: counts[0]])

    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        tensor_in.copy_(tensor_out)

    def barrier(self) -> None:
        return None
