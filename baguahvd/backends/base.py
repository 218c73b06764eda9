"""The two interfaces a transport implements: the data plane and the control plane.

:class:`Communicator` (data plane): collectives over the members of one process set, with
uniform signatures. Buffers are torch tensors; the engine has already checked that shapes,
dtypes and counts agree across ranks, so implementations move bytes and reduce without
re-validating. Counts are in elements of the given tensors.

:class:`ControlPlane`: what the engine needs to negotiate, over every rank of the job and
on channels of its own (user code or data collectives never match its messages):

- one bitwise AND of a byte vector per cycle (cached requests and flags), a gather of
  pickled reports to rank 0, or point-to-point messages that carry them up a tree
  (:meth:`ControlPlane.send`, :meth:`ControlPlane.recv`), and a broadcast of rank 0's
  decision. The AND is started
  (:meth:`ControlPlane.start_bitwise_and`) and its caller waits for it with :func:`waits`,
  which hands control back now and then: the caller decides itself whether to stop waiting
  (its job is ending), and the control plane calls nothing of its caller's;
- an all-gather of integers at start (process identities for the watchdog);
- data communicators for process sets (created collectively by their members);
- alarms: point-to-point messages outside the lockstep protocol, for a rank that can no
  longer follow it (:meth:`ControlPlane.raise_alarm`), polled and acknowledged by peers;
- a bounded exit barrier and an abort that ends the whole job.

Device (GPU) communicators are made by a :data:`DeviceCommFactory` that whoever builds the
engine passes in, so the engine never names a transport.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from baguahvd.common.ops import ReduceOp


def byte_counts(tensor: torch.Tensor, counts: Sequence[int]) -> list[int]:
    """Per-member element counts as bytes of ``tensor``'s dtype: the host backends move a
    collective's data as bytes."""
    item = tensor.element_size()
    return [count * item for count in counts]


class Started(abc.ABC):
    """A collective started without waiting (:meth:`Communicator.start_allreduce`)."""

    @abc.abstractmethod
    def test(self) -> bool:
        """Whether it has completed, its output then in place; never blocks. Raises its
        error once it failed."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Returns once it has completed; raises its error."""

    def notify(self, callback: Callable[[], object]) -> bool:
        """Has ``callback()`` called, from any thread, once the collective has ended
        (completed or failed; at once if it has), after which :meth:`test` from another
        thread is True or raises. The callback may run in the transport's thread before
        the collective is marked done there, so it must not wait for it (setting an event
        is what it is for). False where the transport cannot tell: then only :meth:`test`
        says."""
        return False


class Finished(Started):
    """A collective that ran to its end in the call that started it."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Communicator(abc.ABC):
    """Collectives over a fixed group of ranks."""

    rank: int
    """This process's index in the group."""
    size: int
    """Number of ranks in the group."""
    unfused_bytes: int | None = None
    """Tensors of at least this many bytes are cheaper reduced in a call of their own than
    copied in and out of the fusion buffer (the engine's default; None: always fused)."""
    launches_allreduce: bool = False
    """Whether :meth:`start_allreduce` hands the reduction to threads of the transport,
    which carry it through while the caller goes on (gloo's): the engine then starts the
    next units while it runs. Not MPI's non-blocking collectives, which progress only inside
    the caller's MPI calls."""

    @abc.abstractmethod
    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        """Reduces ``tensor_in`` element-wise over the group into ``tensor_out``.

        ``op`` is SUM, MIN, MAX or PRODUCT, or AVERAGE where :meth:`reduces_average` says so
        (otherwise the engine builds AVERAGE on SUM, and ADASUM always).
        ``tensor_in`` may be ``tensor_out`` for an in-place reduction.
        """

    def start_allreduce(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp
    ) -> Started:
        """:meth:`allreduce`, started without waiting where :attr:`launches_allreduce` says
        so: both tensors stay untouched until the returned :class:`Started` has completed.
        The default runs it in the call."""
        self.allreduce(tensor_in, tensor_out, op)
        return Finished()

    def reduces_average(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`allreduce` takes AVERAGE for tensors of ``dtype``: the sum divided
        by :attr:`size` in one call, rounded as the floating ``dtype`` rounds. Never for
        integers, whose average the engine truncates the way Horovod does."""
        return False

    def allreduce_scaled(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor,
        op: ReduceOp,
        scale: Callable[[torch.Tensor], None],
    ) -> None:
        """:meth:`allreduce`, then ``scale`` applied in place to the result.

        ``scale`` must act element by element: an implementation may apply it to parts of
        the result, each part once, on the rank that completes that part and before the
        others receive it (the MPI ring scales the block it owns while it is in cache).
        """
        self.allreduce(tensor_in, tensor_out, op)
        scale(tensor_out)

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
        order) on rank r in ``tensor_out``; ``op`` as for :meth:`allreduce`."""

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


class Pending(abc.ABC):
    """A control-plane operation under way (:meth:`ControlPlane.start_bitwise_and`); wait for
    it with :func:`waits`."""

    test: Callable[[], bool]
    """Whether the operation has completed; never blocks. Raises the operation's error once
    it failed. A method, or the transport's own test where it has one: it is called in a
    tight loop."""

    def wait(self, timeout_s: float) -> None:
        """Waits ``timeout_s``, or less where the transport can end the wait when the
        operation completes. The default sleeps."""
        time.sleep(timeout_s)

    def notify(self, callback: Callable[[], object]) -> bool:
        """Has ``callback()`` called, from any thread, once the operation has ended (as
        :meth:`Started.notify`). False where the transport cannot tell."""
        return False

    @abc.abstractmethod
    def result(self) -> np.ndarray:
        """The operation's result, once :meth:`test` has returned True."""


SPIN_S = 50e-6
"""How long :func:`waits` polls, yielding the core, before it waits between tests."""
FIRST_WAIT_S = 5e-6
"""The first wait between two tests in :func:`waits`; each next one is twice as long."""
LONGEST_WAIT_S = 1e-4
"""The longest wait between two tests in :func:`waits`, which yields after each one this
long."""


def waits(
    pending: Pending,
    wait: Callable[[float], object] | None = None,
    first_s: float = FIRST_WAIT_S,
    longest_s: float = LONGEST_WAIT_S,
) -> Iterator[None]:
    """Waits for ``pending`` to complete, and yields between two of its tests once the wait
    is no longer short, so that the caller may check whether to give up (and stop iterating
    to do so). Raises the operation's error.

    The other ranks usually come within microseconds (they are waiting too), so it first
    polls for :data:`SPIN_S`, yielding the core between tests: a sleep would end late. Then
    it tests between waits (``wait``, by default :meth:`Pending.wait`: short sleeps) rather
    than in the transport's busy wait or a Python spin: a sleeping thread leaves both the
    CPU (ranks are often oversubscribed) and the GIL (the training thread needs it) to
    others. The waits double from ``first_s`` up to ``longest_s``; from then on it yields
    after each. A caller that is told when the operation ends waits on that instead, as
    long as it likes.
    """
    test = pending.test
    spin_end = time.perf_counter() + SPIN_S
    while not test():
        if time.perf_counter() >= spin_end:
            break
        os.sched_yield()
    else:
        return
    if wait is None:
        wait = pending.wait
    delay = first_s
    while not test():
        wait(delay)
        if delay < longest_s:
            delay = min(delay * 2, longest_s)
        else:
            yield


class ControlPlane(abc.ABC):
    """The engine's negotiation channel over every rank of the job (see module docstring).

    Collective methods must be called by every rank in the same order, from one thread (the
    engine's); the alarm methods may be called from any thread where
    :attr:`threads_multiple` is True.
    """

    rank: int
    """This process's rank in the job."""
    size: int
    """Number of ranks in the job."""
    threads_multiple: bool
    """Whether a second thread may poll alarms while the engine thread waits inside a
    collective of this control plane or of a data communicator."""

    @abc.abstractmethod
    def start_bitwise_and(self, words: np.ndarray) -> Pending:
        """Starts the bitwise AND of the ``uint8`` vector ``words`` over all ranks; the
        :class:`Pending` it returns has the AND as its result. Wait for it with
        :func:`waits`."""

    def bitwise_and(self, words: np.ndarray) -> np.ndarray:
        """The bitwise AND of the ``uint8`` vector ``words`` over all ranks, waited for to
        the end (:meth:`start_bitwise_and` for a caller that may give up)."""
        pending = self.start_bitwise_and(words)
        for _ in waits(pending):
            pass
        return pending.result()

    @abc.abstractmethod
    def gather(self, payload: Any) -> list[Any] | None:
        """Sends the picklable ``payload`` to rank 0; returns the list (by rank) there,
        ``None`` elsewhere."""

    @abc.abstractmethod
    def broadcast(self, payload: Any) -> Any:
        """Returns rank 0's ``payload`` on every rank."""

    @abc.abstractmethod
    def send(self, payload: Any, peer: int) -> None:
        """Sends the picklable ``payload`` to ``peer``, another rank, which takes it with
        :meth:`recv`; may wait until it does. Two ranks' messages arrive in the order sent.
        Raises ValueError for a peer that is this rank or no rank (:func:`check_peer`)."""

    @abc.abstractmethod
    def recv(self, peer: int) -> Any:
        """The next payload that ``peer``, another rank, sent this rank with :meth:`send`,
        waited for. Raises ValueError as :meth:`send` does."""

    @abc.abstractmethod
    def allgather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), by rank."""

    @abc.abstractmethod
    def create_group_comm(self, ranks: Sequence[int]) -> Communicator | None:
        """A data communicator of ``ranks`` (sorted job ranks, more than one), created
        collectively by its members; ``None`` on the other ranks, which may skip the call."""

    @abc.abstractmethod
    def exit_barrier(self, timeout_s: float, ranks: Sequence[int]) -> bool:
        """Waits up to ``timeout_s`` for every one of ``ranks`` (this one among them: every
        rank, or the survivors of a lost one) to call this too, with the same ``ranks``;
        False on timeout. Used once, at exit; usable while the other channels are stuck."""

    @abc.abstractmethod
    def raise_alarm(self, payload: Any, ranks: Sequence[int]) -> None:
        """Sends ``payload`` to ``ranks`` at once, without waiting, whatever they are
        doing."""

    @abc.abstractmethod
    def poll_alarm(self) -> tuple[int, Any] | None:
        """An alarm that arrived, as ``(sending rank, payload)``; never blocks."""

    @abc.abstractmethod
    def acknowledge(self, rank: int) -> None:
        """Tells ``rank`` that its alarm was received."""

    @abc.abstractmethod
    def acknowledged(self) -> set[int]:
        """The ranks that have acknowledged this rank's alarm so far; never blocks."""

    abort_name = "an abort of every rank"
    """How :meth:`abort` ends the job, in the log line that announces it."""

    @abc.abstractmethod
    def abort(self, code: int) -> None:
        """Ends every process of the job."""

    def free(self) -> None:  # noqa: B027 - optional hook
        """Releases the underlying resources."""

    def collective_failed(self) -> bool:
        """Whether a collective of this control plane or of its data communicators has
        failed on this rank: the job is ending then, and a peer whose process is gone is
        the likely cause, which the watchdog may name at once. Callable from any thread.
        The default (MPI, which does not say) is False."""
        return False

    def end_process(self, status: int) -> None:
        """Ends this process with ``status`` once every rank has reached the exit barrier:
        the transport is shut down cleanly first, since the peers are leaving too. The
        default has nothing to shut down."""
        os._exit(status)


def check_peer(control: ControlPlane, peer: int) -> None:
    """Refuses a point-to-point peer that is not another rank of ``control``'s job: gloo
    fails a message to its own rank, waits for one to a rank past the end until its
    timeout, and crashes on a negative one."""
    if not 0 <= peer < control.size or peer == control.rank:
        raise ValueError(
            f"rank {control.rank} cannot exchange messages with rank {peer}: the peer must be "
            f"another rank of the job (0 to {control.size - 1})"
        )


DeviceCommFactory = Callable[[Communicator], Communicator]
"""Makes the device (GPU) communicator of a process set from its data communicator; called
by every member in the same collective, at the set's first device collective."""
