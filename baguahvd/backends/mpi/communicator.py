"""The MPI data plane: collectives on CPU tensors over an mpi4py communicator.

Tensors are handed to MPI as zero-copy NumPy views. Reductions of float16/bfloat16 (which
MPI cannot add) are carried out in float32 and rounded once at the end; byte-moving
collectives (allgather, broadcast, alltoall) send raw bytes, so they work for every dtype.
Large allreduces run as a ring of point-to-point exchanges (:mod:`.ring`), which is faster
than Open MPI's own algorithms at those sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from baguahvd.backends.base import Communicator, byte_counts
from baguahvd.backends.mpi import ring
from baguahvd.backends.nccl import NCCLCommunicator
from baguahvd.common.ops import ReduceOp

_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD,
}

_MPI_TYPES = {
    torch.uint8: MPI.UINT8_T,
    torch.int8: MPI.INT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
}

# Reduced in float32 because MPI has no arithmetic for them.
_WIDENED = (torch.float16, torch.bfloat16)


def _mpi_op(op: ReduceOp) -> Any:
    try:
        return _MPI_OPS[op]
    except KeyError:
        raise ValueError(f"The MPI backend cannot reduce with {op.name} directly.") from None


def _in_place(tensor_in: torch.Tensor, tensor_out: torch.Tensor) -> bool:
    """Whether a collective reads and writes the same memory (MPI's ``IN_PLACE``)."""
    return tensor_in is tensor_out or tensor_in.data_ptr() == tensor_out.data_ptr()


def _typed(tensor: torch.Tensor) -> list[Any]:
    try:
        mpi_type = _MPI_TYPES[tensor.dtype]
    except KeyError:
        raise TypeError(f"The MPI backend cannot reduce tensors of type {tensor.dtype}.") from None
    # numpy() views a contiguous tensor of any shape, which MPI takes as flat memory.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.reshape(-1)
    return [tensor.numpy(), mpi_type]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy()


class MPICommunicator(Communicator):
    """A :class:`Communicator` over an mpi4py communicator (CPU tensors)."""

    unfused_bytes = 2 << 20
    """A call costs tens of microseconds; copying 2 MiB in and out of the fusion buffer
    costs more (``benchmarks/results/shared_memory/NOTES.md``)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        self._allreduce(tensor_in, tensor_out, op, None)

    def allreduce_scaled(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor,
        op: ReduceOp,
        scale: Callable[[torch.Tensor], None],
    ) -> None:
        self._allreduce(tensor_in, tensor_out, op, scale)

    def _allreduce(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor,
        op: ReduceOp,
        scale: Callable[[torch.Tensor], None] | None,
    ) -> None:
        mpi_op = _mpi_op(op)
        if tensor_out.dtype in _WIDENED:
            # Rounded to the narrow type before it is scaled, whichever way it is reduced.
            wide = tensor_in.float()
            self._allreduce(wide, wide, op, None)
            tensor_out.copy_(wide.view_as(tensor_out))
        elif self._takes_ring(tensor_in, tensor_out, op):
            ring.allreduce(self.comm, _flat(tensor_in), _flat(tensor_out), op, scale)
            return
        elif _in_place(tensor_in, tensor_out):
            self.comm.Allreduce(MPI.IN_PLACE, _typed(tensor_out), op=mpi_op)
        else:
            self.comm.Allreduce(_typed(tensor_in), _typed(tensor_out), op=mpi_op)
        if scale is not None:
            scale(tensor_out)

    def _takes_ring(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> bool:
        in_place = _in_place(tensor_in, tensor_out)
        nbytes = tensor_out.numel() * tensor_out.element_size()
        return (
            self.size > 1
            and tensor_out.dtype in _MPI_TYPES
            and ring.takes_ring(op, nbytes, in_place)
        )

    def allgather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, counts: Sequence[int]
    ) -> None:
        sizes = byte_counts(tensor_out, counts)
        displs = np.cumsum([0, *sizes[:-1]]).tolist()
        self.comm.Allgatherv(
            [_bytes(tensor_in), MPI.BYTE], [_bytes(tensor_out), (sizes, displs), MPI.BYTE]
        )

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self.comm.Bcast([_bytes(tensor), MPI.BYTE], root=root)

    def alltoall(
        self,
        tensor_in: torch.Tensor,
        send_counts: Sequence[int],
        tensor_out: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> None:
        send = byte_counts(tensor_in, send_counts)
        recv = byte_counts(tensor_in, recv_counts)
        send_displs = np.cumsum([0, *send[:-1]]).tolist()
        recv_displs = np.cumsum([0, *recv[:-1]]).tolist()
        self.comm.Alltoallv(
            [_bytes(tensor_in), (send, send_displs), MPI.BYTE],
            [_bytes(tensor_out), (recv, recv_displs), MPI.BYTE],
        )

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor,
        counts: Sequence[int],
        op: ReduceOp,
    ) -> None:
        mpi_op = _mpi_op(op)
        if tensor_out.dtype in _WIDENED:
            wide_out = torch.empty(tensor_out.shape, dtype=torch.float32)
            self.comm.Reduce_scatter(
                _typed(tensor_in.float()), _typed(wide_out), list(counts), op=mpi_op
            )
            tensor_out.copy_(wide_out)
        else:
            self.comm.Reduce_scatter(_typed(tensor_in), _typed(tensor_out), list(counts), mpi_op)

    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        self.comm.Sendrecv(
            [_bytes(tensor_out), MPI.BYTE], peer, 0, [_bytes(tensor_in), MPI.BYTE], peer, 0
        )

    def barrier(self) -> None:
        self.comm.Barrier()

    def iallreduce(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp
    ) -> PendingRequest:
        """Starts :meth:`allreduce` without waiting; ``tensor_out`` holds the result once
        the returned request's ``test()`` is True. Both tensors must stay untouched until
        then."""
        mpi_op = _mpi_op(op)
        if tensor_out.dtype in _WIDENED:
            wide = tensor_in.float()
            request = self.comm.Iallreduce(MPI.IN_PLACE, _typed(wide), op=mpi_op)
            return PendingRequest(
                request, (wide,), lambda: tensor_out.copy_(wide.view_as(tensor_out))
            )
        if _in_place(tensor_in, tensor_out):
            request = self.comm.Iallreduce(MPI.IN_PLACE, _typed(tensor_out), op=mpi_op)
        else:
            request = self.comm.Iallreduce(_typed(tensor_in), _typed(tensor_out), op=mpi_op)
        return PendingRequest(request, (tensor_in, tensor_out))

    def ibarrier(self) -> PendingRequest:
        """Starts :meth:`barrier` without waiting."""
        return PendingRequest(self.comm.Ibarrier(), ())

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL and self.comm != MPI.COMM_WORLD:
            self.comm.Free()


class PendingRequest:
    """A started non-blocking collective. Polling it with :meth:`test` (rather than waiting
    inside MPI) lets the caller give up, sleep between polls and keep the GIL free."""

    def __init__(
        self, request: Any, keep_alive: tuple[torch.Tensor, ...], finish: Any = None
    ) -> None:
        self._request = request
        self._keep_alive = keep_alive
        self._finish = finish
        self._done = False

    def test(self) -> bool:
        """Whether the collective has completed (its output is then in place)."""
        if not self._done and self._request.Test():
            self._done = True
            if self._finish is not None:
                self._finish()
            self._keep_alive = ()
        return self._done


def nccl_communicator(comm: Communicator) -> Communicator:
    """The :data:`~baguahvd.backends.base.DeviceCommFactory` of MPI jobs: an NCCL
    communicator of the members of ``comm``, whose MPI communicator carries the NCCL unique
    id. A group of one needs no NCCL: it keeps ``comm``."""
    if not isinstance(comm, MPICommunicator):
        return comm
    return NCCLCommunicator(comm.comm)
