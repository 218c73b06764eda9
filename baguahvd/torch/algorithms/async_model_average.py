"""Asynchronous model averaging (Bagua's AsyncModelAverageAlgorithm; experimental).

Every rank trains on its own, applying only its local gradients, while a background thread
keeps pulling the models of all ranks towards their mean, so a slow rank delays nobody's
optimizer steps (Bagua: Gan et al., "BAGUA: Scaling up Distributed Learning with System
Relaxations", arXiv 2107.01499, section on asynchronous decentralized training; the
scheme follows Lian et al., "Asynchronous Decentralized Parallel Stochastic Gradient
Descent", arXiv 1710.06952).

Steps:

1. **Warmup** (the first ``warmup_steps`` optimizer steps): ordinary bucketed gradient
   allreduce (average), as in :mod:`baguahvd.torch.algorithms.gradient_allreduce`.
2. **Switch** (at the first optimizer step after warmup, on every rank): broadcast the
   weights of the process set's first rank, create two private duplicated communicators
   (one for the averaging rounds, one for the barriers of :meth:`abort`/:meth:`resume`)
   and start the averaging thread. Gradients are no longer communicated.
3. **Averaging rounds** on the thread, ``sync_interval_ms`` apart (measured from the end of
   one round to the start of the next):

   a. abort vote: a 1-byte allreduce-MIN of "this rank has aborted"; the loop ends only
      when every rank has aborted, so all ranks run the same number of rounds;
   b. take a snapshot ``s_i`` of the model, allreduce-SUM it;
   c. correct the model by ``mean_j s_j - s_i`` (:func:`baguahvd.kernels.async_model_average_`),
      which keeps the local progress made while the allreduce was in flight.

Safety without a forward hook: the thread never writes the weights. It reads them only
under a lock that the training thread holds during ``step()`` (the only place where this
optimizer writes them), and it accumulates each round's correction into a pending buffer
``c`` (again under the lock). The model of the algorithm is ``w + c``: snapshots are taken
of ``w + c``, and every ``step()`` folds ``c`` into ``w`` right after the optimizer step,
before the next forward. For each round this gives ``w + c ← (w + c) + (mean_j s_j - s_i)``
with ``s_i`` the snapshot and ``w + c`` including every step taken since, which is Bagua's
update ``w_new = w_now + (mean_j s_j - s_i)``; the correction only becomes visible to the
forward pass at the next step boundary, so forward and backward of one iteration always
see the same weights (Bagua instead locks the model from forward start to backward end).

CUDA parameters (all on one GPU) are averaged as in Bagua, over an NCCL communicator and a
stream of the algorithm's own: the NCCL communicator is made over the private duplicated
communicator (at the thread's first round, collectively), the thread selects the
parameters' GPU once and runs its copies and corrections on its own stream, and the abort
vote stays on the host. The lock orders the host's side; events order the streams: whoever
takes the lock (the training thread in ``step()``, the thread in a round) first makes its
current stream wait for the event the other recorded when it last released the lock, and
records its own before releasing it. So a snapshot is read after the optimizer step that
wrote the weights, and the optimizer step and the fold of ``c`` run after the round that
last read the weights or wrote ``c``.

Like Bagua, call :meth:`abort` on every rank before evaluating or saving (it waits until
every rank has aborted and leaves the averaged corrections in the weights) and
:meth:`resume` before training again. ``hvd.shutdown()`` and interpreter exit stop the
thread too, waiting a bounded time for the other ranks. Change weights outside the
optimizer (loading a checkpoint, broadcasting) only while aborted.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from baguahvd.backends import cuda_support
from baguahvd.common.exceptions import HorovodInternalError
from baguahvd.common.ops import ReduceOp
from baguahvd.kernels import async_model_average_
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    GradientAlgorithmImpl,
    SideStreams,
    bucket_name,
    check_int,
    check_positive,
)
from baguahvd.torch.algorithms.buckets import Bucket, split_into_buckets
from baguahvd.torch.algorithms.primitives import KERNEL_DTYPES
from baguahvd.torch.mpi_ops import Average, allreduce_async_, broadcast_async_, synchronize

if TYPE_CHECKING:
    from baguahvd.backends.base import Communicator
    from baguahvd.backends.mpi import MPICommunicator, PendingRequest

logger = logging.getLogger("baguahvd")

SHUTDOWN_TIMEOUT_S = 30.0
"""How long ``hvd.shutdown()`` (or interpreter exit) waits for the other ranks to stop
averaging before leaving the thread behind."""

_STALL_WARNING_S = 60.0


class AsyncModelAverageAlgorithm(Algorithm):
    """Averages models in a background thread while every rank trains on its own.

    See the module docstring for the steps and the locking scheme.

    Args:
        peer_selection_mode: who averages with whom; only ``"all"`` (every rank).
        sync_interval_ms: pause between the end of one averaging round and the start of
            the next, in milliseconds (> 0).
        warmup_steps: optimizer steps of synchronous gradient allreduce before the
            asynchronous phase (>= 0).

    Raises:
        ValueError: a hyperparameter is out of range; the message names it.
    """

    name = "async"

    def __init__(
        self, peer_selection_mode: str = "all", sync_interval_ms: float = 500,
        warmup_steps: int = 0,
    ) -> None:
        if peer_selection_mode != "all":
            raise ValueError(
                f"peer_selection_mode must be 'all' (the only mode async model averaging "
                f"supports), got {peer_selection_mode!r}."
            )
        check_positive("sync_interval_ms", sync_interval_ms)
        if not math.isfinite(sync_interval_ms):
            raise ValueError(f"sync_interval_ms must be finite, got {sync_interval_ms!r}.")
        check_int("warmup_steps", warmup_steps, 0)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        devices = {
            name: cuda_support.tensor_device(p) if cuda_support.is_cuda(p) else None
            for name, p in context.parameters
        }
        if len(set(devices.values())) > 1:
            where = ", ".join(f"{name} on {device or 'the host'}" for name, device in
                              devices.items())
            raise ValueError(
                "async model averaging averages one model that lives on one device (the "
                f"host or one GPU), but the parameters are spread: {where}."
            )
        for name, p in context.parameters:
            if not p.is_floating_point():
                raise ValueError(
                    f"async model averaging averages floating-point weights; parameter "
                    f"{name} is {p.dtype}."
                )
        if not runtime.mpi_threads_supported():
            raise HorovodInternalError(
                "async model averaging runs MPI on a thread of its own and needs "
                "MPI_THREAD_MULTIPLE; unset HOROVOD_MPI_THREADS_DISABLE."
            )
        return AsyncModelAverageImpl(self, context)

    def abort(self, optimizer: torch.optim.Optimizer) -> None:
        """Stops averaging for ``optimizer`` (Bagua's ``algorithm.abort(model)``); see
        :meth:`AsyncModelAverageImpl.abort`. Does nothing on a single rank."""
        impl = _impl_of(optimizer)
        if impl is not None:
            impl.abort()

    def resume(self, optimizer: torch.optim.Optimizer) -> None:
        """Restarts averaging for ``optimizer``; see :meth:`AsyncModelAverageImpl.resume`."""
        impl = _impl_of(optimizer)
        if impl is not None:
            impl.resume()


def _impl_of(optimizer: torch.optim.Optimizer) -> AsyncModelAverageImpl | None:
    impl = getattr(optimizer, "_impl", None)
    if impl is not None and not isinstance(impl, AsyncModelAverageImpl):
        raise ValueError(
            f"the optimizer runs {type(impl).__name__}, not async model averaging."
        )
    return impl


class _State(enum.Enum):
    NEW = "new"
    """Warmup, or the first asynchronous step has not come yet."""
    RUNNING = "running"
    STOPPED = "stopped"
    """Aborted; resume() restarts."""
    CLOSED = "closed"


class _GaveUp(Exception):
    """The loop was told to stop waiting for the other ranks."""


class AsyncModelAverageImpl(GradientAlgorithmImpl):
    """The hooks of :class:`AsyncModelAverageAlgorithm` and the averaging thread."""

    algorithm: AsyncModelAverageAlgorithm

    def __init__(self, algorithm: AsyncModelAverageAlgorithm, context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        # One bucket per dtype (a bucket size nothing reaches); its flat buffer holds the
        # loop's snapshot, ``_sums`` the allreduced snapshots, ``_pending`` the corrections.
        self._weights = split_into_buckets(context.parameters, 1 << 62)
        self._sums = [torch.empty_like(b.flat) for b in self._weights]
        self._pending = [torch.zeros_like(b.flat) for b in self._weights]
        self._has_pending = False
        self._lock = threading.Lock()
        """Held by the training thread while it writes the weights (step), and by the loop
        while it reads them or updates the pending corrections."""
        self._state = _State.NEW
        self._comm: MPICommunicator | None = None
        self._control: MPICommunicator | None = None
        first = context.parameters[0][1] if context.parameters else None
        self._device = (
            cuda_support.tensor_device(first)
            if first is not None and cuda_support.is_cuda(first) else None
        )
        """The parameters' GPU; None for host parameters."""
        self._device_comm: Communicator | None = None
        """CUDA: the averaging rounds' communicator (NCCL in an MPI job)."""
        self._side = SideStreams()
        # CUDA: the events each side recorded on its stream when it last released the lock
        # (see the module docstring).
        self._training_done: Any = None
        self._loop_done: Any = None
        self._thread: threading.Thread | None = None
        self._aborted = threading.Event()
        self._wake = threading.Event()
        self._give_up = threading.Event()
        self._error: BaseException | None = None
        self.rounds = 0
        """Averaging rounds completed so far (all runs of the loop)."""
        self._cancel_shutdown = runtime.on_shutdown(self.close)

    # -- hooks ---------------------------------------------------------------------------

    @property
    def in_warmup(self) -> bool:
        """Whether gradients are still allreduced (the first ``warmup_steps`` steps)."""
        return self.step_id < self.algorithm.warmup_steps

    @property
    def running(self) -> bool:
        """Whether the averaging thread runs (between the switch or resume() and abort())."""
        return self._state is _State.RUNNING

    def on_backward(self, p: torch.Tensor) -> None:
        if self.in_warmup:
            super().on_backward(p)

    def synchronize(self) -> None:
        if self.in_warmup:
            super().synchronize()

    def communicate(self, bucket: Bucket) -> None:
        synchronize(
            allreduce_async_(
                bucket.flat, name=bucket_name(self.algorithm, bucket), op=Average,
                process_set=self.context.process_set,
            )
        )

    def step(self, closure: Any, optimizer_step: Callable[[Any], Any]) -> Any:
        self._raise_loop_error()
        if not self.in_warmup and self._state is _State.NEW:
            self._switch()
        with self._training_writes():
            result = optimizer_step(closure)
        return result

    # -- control -------------------------------------------------------------------------

    def abort(self) -> None:
        """Stops averaging; collective (call it on every rank).

        Waits on a barrier, marks this rank aborted and waits until the averaging thread
        ends, which happens once every rank has aborted; the corrections received so far
        are then in the weights. Does nothing unless averaging runs (during warmup, or
        when already aborted).

        Raises:
            HorovodInternalError: the averaging thread failed.
        """
        if self._state is not _State.RUNNING:
            return
        self._barrier("abort")
        self._stop(timeout=None)
        self._raise_loop_error()

    def resume(self) -> None:
        """Restarts averaging after :meth:`abort`; collective (call it on every rank).

        Does nothing unless aborted (averaging starts by itself after warmup).
        """
        if self._state is not _State.STOPPED:
            return
        self._barrier("resume")
        with self._training_writes():
            pass  # the weights may have been changed while stopped (a checkpoint loaded)
        self._start_loop()

    def close(self) -> None:
        """Stops the thread (waiting at most :data:`SHUTDOWN_TIMEOUT_S` for the other
        ranks) and frees the communicators; also run by ``hvd.shutdown()``."""
        if self._state is _State.CLOSED:
            return
        self._cancel_shutdown()
        clean = True
        if self._state is _State.RUNNING:
            clean = self._stop(timeout=SHUTDOWN_TIMEOUT_S)
        self._state = _State.CLOSED
        super().close()
        if clean:
            if self._device_comm is not None and self._device_comm is not self._comm:
                self._device_comm.free()
            for comm in (self._comm, self._control):
                if comm is not None:
                    comm.free()
        self._comm = self._control = self._device_comm = None

    # -- internals -----------------------------------------------------------------------

    def _switch(self) -> None:
        process_set = self.context.process_set
        ranks = process_set.ranks
        assert ranks is not None
        handles = [
            broadcast_async_(p.data, min(ranks), name=f"bagua.async.switch.{name}",
                             process_set=process_set)
            for name, p in self.context.parameters
        ]
        for handle in handles:
            synchronize(handle)
        self._training_done = self._record()
        self._comm = runtime.new_communicator(ranks)
        self._control = runtime.new_communicator(ranks)
        if self._device is not None and self._comm is not None:
            self._device_comm = runtime.new_device_communicator(self._comm)
        self._start_loop()

    def _start_loop(self) -> None:
        self._aborted.clear()
        self._wake.clear()
        self._give_up.clear()
        self._error = None
        self._thread = threading.Thread(
            target=self._loop, name="baguahvd-async-average", daemon=True
        )
        self._state = _State.RUNNING
        self._thread.start()

    def _stop(self, timeout: float | None) -> bool:
        """Votes to abort and waits for the loop; False if it was left behind."""
        thread = self._thread
        assert thread is not None
        self._aborted.set()
        self._wake.set()
        started = time.monotonic()
        while thread.is_alive():
            waited = time.monotonic() - started
            if timeout is not None and waited >= timeout:
                break
            slice_s = _STALL_WARNING_S if timeout is None else min(_STALL_WARNING_S,
                                                                   timeout - waited)
            thread.join(slice_s)
            if thread.is_alive() and timeout is None:
                logger.warning(
                    "async model averaging: waited %.0f s for every rank to call abort()",
                    time.monotonic() - started,
                )
        clean = not thread.is_alive()
        if not clean:
            logger.warning(
                "async model averaging: the other ranks did not stop averaging within "
                "%.0f s; leaving the averaging thread behind", timeout,
            )
            self._give_up.set()
            thread.join(1.0)
        self._thread = None
        self._state = _State.STOPPED
        with self._training_writes():
            pass  # leaves the corrections received so far in the weights
        return clean

    def _barrier(self, what: str) -> None:
        assert self._control is not None
        request = self._control.ibarrier()
        started = time.monotonic()
        warned = started
        while not request.test():
            time.sleep(1e-3)
            if time.monotonic() - warned >= _STALL_WARNING_S:
                warned = time.monotonic()
                logger.warning(
                    "async model averaging: waited %.0f s for every rank to call %s()",
                    warned - started, what,
                )

    @contextlib.contextmanager
    def _training_writes(self) -> Iterator[None]:
        """The training thread writes the weights in the block (the optimizer step), then
        folds the pending corrections into them: under the lock, and on CUDA ordered
        after the round that last used them, and the next round after this."""
        with self._lock:
            self._wait_for(self._loop_done)
            yield
            self._fold_pending()
            self._training_done = self._record()

    def _record(self) -> Any:
        """CUDA: an event recorded on this thread's current stream; None on the host."""
        if self._device is None:
            return None
        stream = cuda_support.current_stream_ptr(self._device)
        return cuda_support.record_event(self._device, stream)

    def _wait_for(self, event: Any) -> None:
        """CUDA: this thread's current stream waits for ``event`` (from :meth:`_record`)."""
        if event is not None and self._device is not None:
            stream = cuda_support.current_stream_ptr(self._device)
            cuda_support.wait_event(self._device, stream, event)

    def _fold_pending(self) -> None:
        """w += c (the lock is held)."""
        if not self._has_pending:
            return
        for bucket, pending in zip(self._weights, self._pending):
            offset = 0
            for p in bucket.params:
                count = p.numel()
                p.data.add_(pending[offset : offset + count].view_as(p))
                offset += count
            pending.zero_()
        self._has_pending = False

    def _raise_loop_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise HorovodInternalError(f"async model averaging failed: {error}") from error

    def _loop(self) -> None:
        # This thread talks to CUDA while the training thread may capture a CUDA graph.
        cuda_support.relax_capture_mode()
        try:
            with torch.no_grad(), self._side.on(self._device) as stream:
                if stream is not None:
                    assert self._device is not None
                    # Allocated on the training thread's stream, used on this one.
                    for buffer in (*self._sums, *self._pending,
                                   *(b.flat for b in self._weights)):
                        cuda_support.record_stream(buffer, self._device, stream)
                while self._round():
                    self.rounds += 1
                    # Set by abort(): no more pauses, so that the final vote comes soon.
                    self._wake.wait(self.algorithm.sync_interval_ms / 1000.0)
        except _GaveUp:
            return
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
            logger.exception("async model averaging failed")
            self._error = exc

    def _round(self) -> bool:
        """One round (steps 3a-3c); False once every rank has aborted."""
        comm = self._comm
        assert comm is not None
        vote = torch.tensor([1 if self._aborted.is_set() else 0], dtype=torch.uint8)
        self._wait(comm.iallreduce(vote, vote, ReduceOp.MIN))
        if int(vote.item()) > 0:
            return False
        with self._lock:
            self._wait_for(self._training_done)
            snapshots = [
                b.gather_weights().add_(c) for b, c in zip(self._weights, self._pending)
            ]
            self._loop_done = self._record()
        for snapshot, total in zip(snapshots, self._sums):
            if self._device_comm is not None:
                # Every rank voted to go on, so every rank takes part: no giving up here
                # (the NCCL timeout still applies).
                self._device_comm.allreduce(snapshot, total, ReduceOp.SUM)
            else:
                self._wait(comm.iallreduce(snapshot, total, ReduceOp.SUM))
        with self._lock:
            self._wait_for(self._training_done)
            for pending, total, snapshot in zip(self._pending, self._sums, snapshots):
                if pending.dtype in KERNEL_DTYPES:
                    async_model_average_(pending, total, snapshot, comm.size)
                else:
                    pending.add_(total / comm.size - snapshot)
            self._loop_done = self._record()
            self._has_pending = True
        return True

    def _wait(self, request: PendingRequest) -> None:
        """Polls ``request`` with short sleeps (the GIL and the CPU stay free), giving up
        when told to."""
        delay = 1e-5
        while not request.test():
            if self._give_up.is_set():
                raise _GaveUp
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
