"""The MPI control plane: the engine's negotiation over duplicates of the job's communicator.

Three duplicates keep three kinds of traffic apart: the lockstep negotiation (one
non-blocking bitwise AND, a gather to rank 0 or messages up a tree, tagged
``_TAG_NEGOTIATION``, and a broadcast per cycle), alarms (point to
point, outside the lockstep protocol, tagged ``_TAG_ALARM`` and answered with ``_TAG_ACK``)
and the exit barrier used after a failure, when the negotiation communicator may be stuck
in a collective that will never complete.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from baguahvd.backends.base import ControlPlane, Pending, check_peer
from baguahvd.backends.mpi.communicator import MPICommunicator

# The tag of point-to-point messages of the negotiation (see MPIControlPlane.send).
_TAG_NEGOTIATION = 4
# Tags of the alarm communicator (see MPIControlPlane.raise_alarm).
_TAG_ALARM = 1
_TAG_ACK = 2
_TAG_EXIT = 3


class MPIControlPlane(ControlPlane):
    """The engine's private communicators: negotiation messages and process-set creation.

    It is a duplicate of the job's communicator, so user code that also calls MPI never
    matches the engine's messages.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # Point-to-point messages outside the lockstep protocol: a rank that leaves it tells
        # the others through this one (see raise_alarm).
        self._alarm_comm = comm.Dup()
        self._alarm_lock = threading.Lock()
        self._outgoing: list[Any] = []
        self._acknowledged: set[int] = set()
        self.threads_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        """Whether a second thread may call MPI while the engine thread is inside MPI."""

    def start_bitwise_and(self, words: np.ndarray) -> Pending:
        """Starts the bitwise AND of ``words`` over all ranks (a non-blocking MPI
        allreduce)."""
        result = np.empty_like(words)
        request = self.comm.Iallreduce([words, MPI.BYTE], [result, MPI.BYTE], op=MPI.BAND)
        return _PendingAnd(request, words, result)

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

    def send(self, payload: Any, peer: int) -> None:
        """Pickles ``payload`` to ``peer`` (a standard-mode send: a large payload waits for
        the receive)."""
        check_peer(self, peer)
        self.comm.send(payload, dest=peer, tag=_TAG_NEGOTIATION)

    def recv(self, peer: int) -> Any:
        """The next payload ``peer`` sent this rank."""
        check_peer(self, peer)
        return self.comm.recv(source=peer, tag=_TAG_NEGOTIATION)

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

    def exit_barrier(self, timeout_s: float, ranks: Sequence[int]) -> bool:
        """Waits up to ``timeout_s`` for every one of ``ranks`` to call this too; False on
        timeout. Each sends the others a message on the alarm communicator: a barrier of a
        communicator would wait for a dead rank, and for one that cannot finalize."""
        deadline = time.monotonic() + timeout_s
        others = {rank for rank in ranks if rank != self.rank}
        with self._alarm_lock:
            for rank in others:
                self._outgoing.append(self._alarm_comm.isend(None, dest=rank, tag=_TAG_EXIT))
        while True:
            with self._alarm_lock:
                for rank in list(others):
                    message = self._alarm_comm.improbe(rank, _TAG_EXIT)
                    if message is not None:
                        message.recv()
                        others.discard(rank)
            if not others:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

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

    abort_name = "MPI_Abort"

    def abort(self, code: int) -> None:
        """Ends every process of the job (MPI_Abort on MPI_COMM_WORLD)."""
        MPI.COMM_WORLD.Abort(code)

    def end_process(self, status: int) -> None:
        """Finalizes MPI (every rank passed the exit barrier, so it cannot block), then ends
        the process with ``status`` (MPI's exit handler would otherwise exit with 0)."""
        MPI.Finalize()
        os._exit(status)

    def free(self) -> None:
        self.comm.Free()
        self._alarm_comm.Free()


class _PendingAnd(Pending):
    """An ``Iallreduce`` under way, with the buffers it reads and writes."""

    def __init__(self, request: Any, words: np.ndarray, result: np.ndarray) -> None:
        self.test = request.Test
        self._words = words
        self._result = result

    def result(self) -> np.ndarray:
        return self._result
