"""The gloo control plane: the engine's negotiation over process groups of its own, and
alarms, the exit barrier and abort through the job's store.

Negotiation (one bitwise AND per cycle, a gather to rank 0 or messages up a tree, and a
broadcast) runs on a process group that carries nothing else, so it never interleaves with
data collectives, which run on the groups :meth:`GlooControlPlane.create_group_comm` makes.

gloo has no message that can be probed without blocking, so the traffic outside the
lockstep protocol goes through the store, on a connection of its own (a clone of the
job's store, so it never waits behind the engine thread):

- an alarm to rank ``r`` takes the next slot of ``alarm/<r>/slots`` (an atomic counter)
  and writes the pickled ``(sender, payload)`` under ``alarm/<r>/<slot>``; rank ``r``
  reads its slots in order, looking with ``check`` (which never blocks) before reading;
- an acknowledgement of ``s``'s alarm by ``r`` is the key ``ack/<s>/<r>``;
- at the exit barrier each rank writes ``exit/<rank>`` and waits for the keys of the
  others that meet (every rank, or the survivors of a lost one), or gives up at its
  deadline;
- abort writes ``abort`` and ends the process; every other rank's next alarm poll (the
  watchdog's, ten times a second) finds it and ends too, as MPI_Abort would end them.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from baguahvd.backends.base import ControlPlane, Pending, check_peer
from baguahvd.backends.gloo.communicator import (
    GlooCommunicator,
    PendingWork,
    reduce_options,
    wait,
)
from baguahvd.backends.gloo.setup import GlooWorld

logger = logging.getLogger("baguahvd")

_ABORT_KEY = "abort"
# The tag of point-to-point messages of the negotiation (see GlooControlPlane.send).
_TAG_NEGOTIATION = 1


class GlooControlPlane(ControlPlane):
    """The engine's negotiation channel over gloo (see the module docstring)."""

    threads_multiple = True
    """The watchdog may poll alarms (the store) while the engine thread waits in gloo."""

    def __init__(self, world: GlooWorld) -> None:
        self.world = world
        self.rank = world.rank
        self.size = world.size
        self._group = world.group(range(world.size), "control")
        self._store = _own_connection(world.store)
        self._lock = threading.Lock()
        self._next_alarm = 0
        self._acknowledged: set[int] = set()

    # -- the lockstep protocol (engine thread) ------------------------------------------

    def start_bitwise_and(self, words: np.ndarray) -> Pending:
        """Starts the bitwise AND of the ``uint8`` vector ``words`` over all ranks."""
        result = torch.from_numpy(np.array(words, dtype=np.uint8, copy=True))
        work = self._group.allreduce([result], reduce_options(dist.ReduceOp.BAND))
        return _PendingAnd(work, result, self.world.failed)

    def gather(self, payload: Any) -> list[Any] | None:
        """Pickles ``payload`` to rank 0; returns the list (by rank) there, ``None`` elsewhere.
        Each message is padded to the longest (found by a MAX allreduce first)."""
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        longest = torch.tensor([len(data)], dtype=torch.int64)
        wait(self._group.allreduce([longest], reduce_options(dist.ReduceOp.MAX)), self.world.failed)
        width = 8 + int(longest.item())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        mine[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            wait(self._group.gather([], [mine], options), self.world.failed)
            return None
        blocks = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        wait(self._group.gather([blocks], [mine], options), self.world.failed)
        result = []
        for block in blocks:
            length = int(block[:8].view(torch.int64).item())
            result.append(pickle.loads(block[8 : 8 + length].numpy().tobytes()))
        return result

    def broadcast(self, payload: Any) -> Any:
        """Rank 0's ``payload`` on every rank (its length first, then its bytes)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        wait(self._group.broadcast([length], options), self.world.failed)
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        if self.rank == 0:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        wait(self._group.broadcast([buffer], options), self.world.failed)
        return payload if self.rank == 0 else pickle.loads(buffer.numpy().tobytes())

    def send(self, payload: Any, peer: int) -> None:
        """Pickles ``payload`` to ``peer``: its length, then its bytes."""
        check_peer(self, peer)
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        length = torch.tensor([len(data)], dtype=torch.int64)
        wait(self._group.send([length], peer, _TAG_NEGOTIATION), self.world.failed)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        wait(self._group.send([buffer], peer, _TAG_NEGOTIATION), self.world.failed)

    def recv(self, peer: int) -> Any:
        """The next payload ``peer`` sent this rank."""
        check_peer(self, peer)
        length = torch.empty(1, dtype=torch.int64)
        wait(self._group.recv([length], peer, _TAG_NEGOTIATION), self.world.failed)
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        wait(self._group.recv([buffer], peer, _TAG_NEGOTIATION), self.world.failed)
        return pickle.loads(buffer.numpy().tobytes())

    def allgather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), by rank."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        blocks = [torch.empty_like(mine) for _ in range(self.size)]
        wait(self._group.allgather([blocks], [mine]), self.world.failed)
        return [block.tolist() for block in blocks]

    def create_group_comm(self, ranks: Sequence[int]) -> GlooCommunicator | None:
        """A data communicator of ``ranks`` (sorted), made by its members; ``None`` on the
        others, which may skip the call."""
        return self.world.new_communicator(ranks, "data")

    # -- outside the protocol (any thread) ----------------------------------------------

    def exit_barrier(self, timeout_s: float, ranks: Sequence[int]) -> bool:
        """Waits up to ``timeout_s`` for every one of ``ranks`` to call this too; False on
        timeout."""
        deadline = time.monotonic() + timeout_s
        keys = [f"exit/{rank}" for rank in ranks]
        with self._lock:
            self._store.set(f"exit/{self.rank}", b"1")
        while True:
            with self._lock:
                if self._store.check(keys):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def raise_alarm(self, payload: Any, ranks: Sequence[int]) -> None:
        """Writes ``payload`` into the next alarm slot of each of ``ranks``. When the store
        no longer answers (its host, rank 0, is gone), says so and returns: the caller must
        still fail its own collectives, and the other ranks find the lost peer themselves."""
        message = pickle.dumps((self.rank, payload), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                for rank in ranks:
                    slot = self._store.add(f"alarm/{rank}/slots", 1) - 1
                    self._store.set(f"alarm/{rank}/{slot}", message)
            except RuntimeError as error:  # torch's DistNetworkError and DistStoreError
                logger.warning(
                    "cannot raise the alarm for ranks %s: the job's store does not answer (%s)",
                    list(ranks), str(error).splitlines()[0],
                )

    def poll_alarm(self) -> tuple[int, Any] | None:
        """The next alarm sent to this rank, as ``(sending rank, payload)``; never blocks.
        Ends this process when another rank aborted the job."""
        with self._lock:
            if self._store.check([_ABORT_KEY]):
                self._aborted()
            key = f"alarm/{self.rank}/{self._next_alarm}"
            if not self._store.check([key]):
                return None
            self._next_alarm += 1
            source, payload = pickle.loads(self._store.get(key))
            return int(source), payload

    def acknowledge(self, rank: int) -> None:
        """Tells ``rank`` that its alarm was received."""
        with self._lock:
            self._store.set(f"ack/{rank}/{self.rank}", b"1")

    def acknowledged(self) -> set[int]:
        """The ranks that have acknowledged this rank's alarm so far; never blocks."""
        with self._lock:
            for rank in range(self.size):
                if rank not in self._acknowledged and self._store.check(
                    [f"ack/{self.rank}/{rank}"]
                ):
                    self._acknowledged.add(rank)
            return set(self._acknowledged)

    abort_name = "a gloo abort (every rank exits at its next poll of the store)"

    def abort(self, code: int) -> None:
        """Ends every process of the job: this one now, the others at their next poll."""
        try:
            with self._lock:
                self._store.set(_ABORT_KEY, str(code).encode())
        finally:
            os._exit(code)

    def _aborted(self) -> None:
        code = int(self._store.get(_ABORT_KEY).decode() or 1)
        logger.error("another rank ended the job (abort); ending this rank too")
        for handler in logging.getLogger("baguahvd").handlers:
            handler.flush()
        os._exit(code)

    def collective_failed(self) -> bool:
        return self.world.failed.is_set()

    def free(self) -> None:
        self._group = None


class _PendingAnd(Pending):
    """A gloo allreduce under way, with the tensor it reduces in place.

    Where MPI would wait forever for a peer that died, gloo fails the collective as soon as
    the peer's connection closes: :meth:`test` then sets the world's ``failed`` (the
    watchdog names a gone peer at once after that) and raises gloo's error.
    """

    def __init__(self, work: Any, result: torch.Tensor, failed: threading.Event) -> None:
        self._started = PendingWork(work, (result,), failed=failed)
        self._result = result
        self.test = self._started.test

    def notify(self, callback: Callable[[], object]) -> bool:
        """Calls ``callback()`` when gloo's future for the AND completes (as
        :meth:`PendingWork.notify`)."""
        return self._started.notify(callback)

    def result(self) -> np.ndarray:
        return self._result.numpy()


def _own_connection(store: Any) -> Any:
    """A connection to ``store`` of its own (a clone), where the store can make one."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):
        return store
