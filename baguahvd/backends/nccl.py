"""NCCL through CuPy: the collectives of CUDA tensors.

One :class:`NCCLCommunicator` spans the members of one process set. It is built around the
set's MPI communicator and does nothing until its first CUDA tensor arrives; then it imports
CuPy (the only CuPy import of the collectives), the set's first rank creates an NCCL unique
id, MPI broadcasts it to the members and every member creates its NCCL communicator on the
tensor's device. The engine runs every member's collectives in the same order, so that lazy
creation is itself collective. Creation waits with the collective timeout and the engine's
stop state instead of blocking in MPI or NCCL (see :mod:`baguahvd.backends.nccl_setup`).

Streams. Each communicator has its own CUDA stream. When a CUDA tensor is submitted, the
submitting thread records an event on its current torch stream (a :class:`StreamMark`): the
collective's stream waits for it, so NCCL never reads a gradient before the kernels that
write it, whichever stream the user runs them on. The engine runs a unit (copy into the
fusion buffer, scaling, the NCCL call) with the communicator's stream as torch's current
stream (:meth:`NCCLCommunicator.ordered`), records a completion event and goes on to the
next unit without waiting; it completes the unit's handles once it has seen that event fire
(:meth:`NCCLCommunicator.finished`). What writes the users' outputs from an allreduce's
results (scaling after it, copy out) runs as a second such unit, launched once the first
finished without error (:meth:`NCCLCommunicator.check_succeeded`): kernels still queued
behind an aborted NCCL call write nothing. The submitting streams do not wait for the event,
so the user's later kernels run while the unit communicates; they see the results because
the user reads them only after the handle completed. Each thread that talks to CUDA for a
communicator selects the communicator's device once (CuPy's and torch's), and never switches
back to GPU 0.

The engine thread watches completion events with a deadline instead of blocking in CUDA:
an NCCL error reported asynchronously, or a collective that does not finish in time (a peer
died or never called it), aborts the communicator and raises :class:`NCCLError` or
:class:`NCCLTimeoutError` instead of hanging.

Buffers are handed to NCCL as raw device pointers (``data_ptr()``), without copies.
Reductions need a type NCCL knows; collectives that only move data send bytes, so they work
for every dtype.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from baguahvd.backends import cuda_support, nccl_setup
from baguahvd.backends.base import Communicator
from baguahvd.backends.cuda_support import (
    BFLOAT16_MIN_VERSION,
    NCCLError,
    NCCLTimeoutError,
    NCCLUnavailableError,
    StreamMark,
)
from baguahvd.common.ops import ReduceOp

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
"""How long a collective may take before the communicator is aborted (torch's NCCL default)."""

_FIRST_POLL_S = 2e-6
_LONGEST_POLL_S = 1e-3

__all__ = [
    "BFLOAT16_MIN_VERSION", "DEFAULT_TIMEOUT_S", "LaunchedUnit", "NCCLCommunicator", "NCCLError",
    "NCCLTimeoutError", "NCCLUnavailableError", "StreamMark", "cross_communicator",
    "local_communicator", "single_rank_communicator",
]


class LaunchedUnit:
    """A unit of the engine launched on a communicator's stream by
    :meth:`NCCLCommunicator.ordered`: what it is (for errors), its device, its deadline
    (launch time plus the timeout), the tensors it made for the submitters and, once its
    body has run, its completion event."""

    __slots__ = ("what", "device", "deadline", "produced", "done")

    def __init__(self, what: str, device: torch.device, deadline: float) -> None:
        self.what = what
        self.device = device
        self.deadline = deadline
        self.produced: list[torch.Tensor] = []
        self.done: Any = None


class NCCLCommunicator(Communicator):
    """A :class:`Communicator` over NCCL for CUDA tensors of one device per process.

    Args:
        comm: the process set's mpi4py communicator; it carries the NCCL unique id from the
            set's first rank to the others when the NCCL communicator is created.
        timeout_s: how long one collective may run before the communicator is aborted and
            :class:`NCCLTimeoutError` raised.
    """

    def __init__(self, comm: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        self.timeout_s = float(timeout_s)
        self._cupy: Any = None
        self._nccl: Any = None
        self._dtypes: dict[torch.dtype, int] = {}
        self._ops: dict[ReduceOp, int] = {}
        self._device: torch.device | None = None
        self._handle: Any = None
        self._stream: Any = None
        self._aborted: str | None = None
        self._threads: set[int] = set()
        self._in_unit = False
        self._p2p_connected = False
        self.native_average = False
        """Whether Average uses ``ncclAvg`` where NCCL has it (BAGUAHVD_NCCL_AVERAGE)."""
        # The engine's stop error, asked while polling: a stopped engine aborts the wait.
        self.stopped: Callable[[], BaseException | None] | None = None

    @property
    def device(self) -> torch.device | None:
        """The device the NCCL communicator lives on; ``None`` before its first collective."""
        return self._device

    # ----------------------------------------------------------------------------------
    # Creation

    def _load(self) -> Any:
        if self._nccl is None:
            cupy = cuda_support.import_cupy()
            self._dtypes = cuda_support.dtype_table(cupy.cuda.nccl)
            self._ops = cuda_support.op_table(cupy.cuda.nccl)
            self._cupy, self._nccl = cupy, cupy.cuda.nccl
        return self._nccl

    def _bind(self, device: torch.device) -> None:
        """Creates the NCCL communicator on ``device``: collective over the members."""
        if self._aborted is not None:
            raise NCCLError(f"the NCCL communicator was aborted earlier: {self._aborted}")
        if self._handle is not None:
            if device != self._device:
                raise NCCLError(
                    f"this process set's NCCL communicator lives on {self._device}, but a "
                    f"tensor on {device} was submitted; use one GPU per process "
                    "(torch.cuda.set_device(hvd.local_rank())) and keep tensors on it."
                )
            return
        self._load()
        self._select(device)
        try:
            handle, stream = nccl_setup.create(
                self._cupy, self.comm, self.rank, self.size, int(device.index or 0),
                self.timeout_s, self.stopped,
            )
        except NCCLError as exc:
            # Creation is collective: a member that gave up cannot join a later attempt.
            self._aborted = str(exc)
            raise
        self._stream = stream
        self._handle = handle
        self._device = device
        logger.debug("NCCL communicator of %d ranks created on %s", self.size, device)

    def _select(self, device: torch.device) -> None:
        """Selects ``device`` in CuPy and torch for the calling thread, once per thread. A
        thread never switches back: that would make a CUDA context on another GPU."""
        thread = threading.get_ident()
        if thread in self._threads:
            return
        self._cupy.cuda.Device(device.index).use()
        cuda_support.set_torch_device(device)
        self._threads.add(thread)

    def _reduce_type(self, dtype: torch.dtype) -> int:
        self._load()
        try:
            return self._dtypes[dtype]
        except KeyError:
            raise TypeError(f"The NCCL backend cannot reduce tensors of type {dtype}.") from None

    def _reduce_op(self, op: ReduceOp) -> int:
        self._load()
        try:
            return self._ops[op]
        except KeyError:
            raise ValueError(f"The NCCL backend cannot reduce with {op.name} directly.") from None

    def reduces_average(self, dtype: torch.dtype) -> bool:
        # ncclAvg (NCCL >= 2.10) for the floating types NCCL reduces itself, when asked for
        # (BAGUAHVD_NCCL_AVERAGE): it does not round as Horovod's scaled sum does.
        if not self.native_average:
            return False
        self._load()
        return (
            dtype.is_floating_point and dtype in self._dtypes and ReduceOp.AVERAGE in self._ops
        )

    def _needs_widening(self, dtype: torch.dtype) -> bool:
        # bfloat16 before NCCL 2.10: reduced in float32 and rounded once at the end.
        self._load()
        return dtype == torch.bfloat16 and dtype not in self._dtypes

    def _move_type(self, tensor: torch.Tensor) -> tuple[int, int]:
        """The NCCL type that moves ``tensor`` and the number of those per element: its own
        type when NCCL has one, else bytes (bool, int16, ...)."""
        self._load()
        code = self._dtypes.get(tensor.dtype)
        if code is not None:
            return code, 1
        return self._dtypes[torch.uint8], tensor.element_size()

    # ----------------------------------------------------------------------------------
    # Running one collective

    def _run(
        self, what: str, device: torch.device, launch: Callable[[Any, int], None],
        point_to_point: bool = False,
    ) -> None:
        """Runs ``launch(nccl_communicator, stream_handle)`` on the NCCL stream, ordered after
        torch's current stream and before whatever it runs next, and waits for completion
        with the timeout."""
        self._bind(device)
        self._select(device)
        if self._in_unit:
            # Inside ordered(): the stream order is already arranged around the whole unit.
            self._launch(what, device, launch, point_to_point)
            return
        cupy = self._cupy
        consumer = cuda_support.external_stream(
            cupy, cuda_support.current_stream_ptr(device), int(device.index or 0)
        )
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(consumer)
        self._stream.wait_event(ready)
        self._launch(what, device, launch, point_to_point)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self._stream)
        consumer.wait_event(done)
        self._wait(done, what, device)

    def _launch(
        self, what: str, device: torch.device, launch: Callable[[Any, int], None],
        point_to_point: bool = False,
    ) -> None:
        """Queues ``launch`` on the NCCL stream. The first point-to-point launch of the
        communicator (NCCL connects those peers lazily, inside ``ncclGroupEnd``, blocking
        the calling thread) runs on a helper thread watched with the collective's deadline:
        a peer that never connects aborts the communicator instead of holding the engine."""
        try:
            if point_to_point and not self._p2p_connected:
                self._launch_watched(what, device, launch)
                self._p2p_connected = True
            else:
                launch(self._handle, self._stream.ptr)
        except self._nccl.NcclError as exc:
            raise NCCLError(f"NCCL {what} on {device} failed: {exc}") from exc

    def _launch_watched(
        self, what: str, device: torch.device, launch: Callable[[Any, int], None]
    ) -> None:
        handle, stream = self._handle, self._stream.ptr
        cupy, index = self._cupy, device.index
        # ``done`` once the call returned or raised ``error``: what _wait polls.
        outcome = SimpleNamespace(done=False, error=None)

        def connect() -> None:
            cuda_support.relax_capture_mode()
            try:
                cupy.cuda.Device(index).use()
                cuda_support.set_torch_device(device)
                launch(handle, stream)
            except BaseException as exc:  # noqa: BLE001 - handed to the engine thread
                outcome.error = exc
            outcome.done = True

        helper = threading.Thread(target=connect, name="baguahvd-nccl-connect", daemon=True)
        helper.start()
        self._wait(outcome, f"{what} (connecting its peers)", device)
        if outcome.error is not None:
            raise outcome.error

    @contextmanager
    def ordered(
        self, device: torch.device, marks: Sequence[StreamMark], what: str = "collective"
    ) -> Iterator[LaunchedUnit]:
        """Launches the body (a unit of the engine) on this communicator's stream, after the
        submissions of ``marks``, and returns without waiting for it: the
        :class:`LaunchedUnit` it yields records the unit's completion event once the body
        has run, and :meth:`finished` tells when that event has fired. The body lists the
        tensors it made for the submitters (allocated on this stream) in ``produced``:
        they are recorded for the submitting streams, which read them once the unit's
        handles have completed.

        The submitting streams do not wait for the unit: their later kernels (the rest of a
        backward pass) run while it communicates. The engine completes the unit's handles
        only after the host saw its event fire, so whatever the user queues after waiting
        for a handle is ordered after the unit."""
        self._bind(device)
        self._select(device)
        for mark in marks:
            self._stream.wait_event(mark.ready)
        launched = LaunchedUnit(what, device, time.monotonic() + self.timeout_s)
        self._in_unit = True
        try:
            with cuda_support.on_stream(device, self._stream.ptr):
                yield launched
        finally:
            self._in_unit = False
        done = self._cupy.cuda.Event(disable_timing=True)
        done.record(self._stream)
        for consumer in dict.fromkeys(mark.consumer for mark in marks):
            for tensor in launched.produced:
                cuda_support.record_stream(tensor, device, consumer)
        launched.done = done

    def finished(self, launched: LaunchedUnit) -> bool:
        """Whether the unit launched by :meth:`ordered` has finished, without blocking.

        Raises:
            NCCLError: NCCL reported an asynchronous error, the communicator was aborted or
                the engine stopped; the communicator is aborted.
            NCCLTimeoutError: the unit did not finish within the timeout; the communicator
                is aborted.
        """
        if launched.done is not None and launched.done.done:
            return True
        self._check_stuck(launched.what, launched.device, launched.deadline)
        return False

    def check_succeeded(self, launched: LaunchedUnit) -> None:
        """After :meth:`finished` said True: raises if the communicator was aborted or NCCL
        reported an asynchronous error meanwhile (an aborted collective's kernels end, so its
        event fires too), so that nothing that uses the unit's results is queued after it.

        Raises:
            NCCLError: as :meth:`finished` does; the communicator is aborted.
        """
        if self._aborted is not None:
            raise NCCLError(
                f"NCCL {launched.what} on {launched.device} did not complete: the NCCL "
                f"communicator was aborted: {self._aborted}"
            )
        self._check_async_error(launched.what, launched.device)

    def wait(self, launched: LaunchedUnit) -> None:
        """Waits (polling) until the unit launched by :meth:`ordered` has finished; raises
        as :meth:`finished` does."""
        self._wait(launched.done, launched.what, launched.device, launched.deadline)

    @contextmanager
    def _group(self) -> Iterator[None]:
        """NCCL calls issued inside run as one operation (needed for send/recv pairs)."""
        self._nccl.groupStart()
        try:
            yield
        finally:
            self._nccl.groupEnd()

    def _wait(
        self, done: Any, what: str, device: torch.device, deadline: float | None = None
    ) -> None:
        """Polls ``done.done`` between short sleeps (which leave the GIL to the training thread),
        checking NCCL's asynchronous error state, until it is true or the deadline passes."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        delay = _FIRST_POLL_S
        while not done.done:
            self._check_stuck(what, device, deadline)
            time.sleep(delay)
            delay = min(delay * 2, _LONGEST_POLL_S)

    def _check_stuck(self, what: str, device: torch.device, deadline: float) -> None:
        """Raises (aborting the communicator) when a collective still running never will
        finish: NCCL reported an error, the communicator was aborted, the engine stopped,
        or the deadline passed."""
        if self._aborted is not None:
            raise NCCLError(
                f"NCCL {what} on {device} cannot finish: the NCCL communicator was aborted: "
                f"{self._aborted}"
            )
        self._check_async_error(what, device)
        stopped = self.stopped() if self.stopped is not None else None
        if stopped is not None:
            reason = f"NCCL {what} on {device} was abandoned because the engine stopped"
            self.abort(f"{reason}: {stopped}")
            raise NCCLError(f"{reason}: {stopped}. The NCCL communicator was aborted.")
        if time.monotonic() >= deadline:
            reason = (
                f"NCCL {what} on {device} did not finish within {self.timeout_s:g} s; a "
                "peer may have died or not submitted the same collective"
            )
            self.abort(reason)
            raise NCCLTimeoutError(f"{reason}. The NCCL communicator was aborted.")

    def _check_async_error(self, what: str, device: torch.device) -> None:
        check = getattr(self._handle, "check_async_error", None)
        if check is None:
            return
        try:
            check()
        except self._nccl.NcclError as exc:
            reason = f"NCCL {what} on {device} failed: {exc}"
            self.abort(reason)
            raise NCCLError(f"{reason}. The NCCL communicator was aborted.") from exc

    def abort(self, reason: str) -> None:
        """Aborts the NCCL communicator (``ncclCommAbort``), which also ends the kernels still
        waiting on peers; every later collective raises :class:`NCCLError`."""
        self._aborted = reason
        handle, self._handle = self._handle, None
        if handle is None:
            return
        logger.error("aborting the NCCL communicator: %s", reason)
        nccl_setup.abort_communicator(handle)

    # ----------------------------------------------------------------------------------
    # Collectives

    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        device = cuda_support.tensor_device(tensor_out)
        if self._needs_widening(tensor_out.dtype):
            wide = tensor_in.float()
            self.allreduce(wide, wide, op)
            tensor_out.copy_(wide)
            return
        dtype = self._reduce_type(tensor_out.dtype)
        nccl_op = self._reduce_op(op)
        send, recv = cuda_support.device_ptr(tensor_in), cuda_support.device_ptr(tensor_out)
        count = tensor_out.numel()
        self._run(
            "allreduce",
            device,
            lambda comm, stream: comm.allReduce(send, recv, count, dtype, nccl_op, stream),
        )

    def allgather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, counts: Sequence[int]
    ) -> None:
        device = cuda_support.tensor_device(tensor_out)
        dtype, per_element = self._move_type(tensor_out)
        offsets = cuda_support.block_offsets(counts)
        counts = list(counts)

        def launch(comm: Any, stream: int) -> None:
            if len(set(counts)) == 1:
                comm.allGather(
                    cuda_support.device_ptr(tensor_in), cuda_support.device_ptr(tensor_out),
                    counts[0] * per_element, dtype, stream,
                )
                return
            # Uneven blocks: every rank broadcasts its block into place.
            with self._group():
                for root, (count, offset) in enumerate(zip(counts, offsets)):
                    if count == 0:
                        continue
                    target = cuda_support.device_ptr(tensor_out, offset)
                    source = cuda_support.device_ptr(tensor_in) if root == self.rank else target
                    comm.broadcast(source, target, count * per_element, dtype, root, stream)

        self._run("allgather", device, launch)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        device = cuda_support.tensor_device(tensor)
        dtype, per_element = self._move_type(tensor)
        address, count = cuda_support.device_ptr(tensor), tensor.numel() * per_element
        self._run(
            "broadcast",
            device,
            lambda comm, stream: comm.broadcast(address, address, count, dtype, root, stream),
        )

    def alltoall(
        self,
        tensor_in: torch.Tensor,
        send_counts: Sequence[int],
        tensor_out: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> None:
        device = cuda_support.tensor_device(tensor_out)
        dtype, per_element = self._move_type(tensor_out)
        send_offsets = cuda_support.block_offsets(send_counts)
        recv_offsets = cuda_support.block_offsets(recv_counts)

        def launch(comm: Any, stream: int) -> None:
            with self._group():
                for peer in range(self.size):
                    if send_counts[peer]:
                        comm.send(
                            cuda_support.device_ptr(tensor_in, send_offsets[peer]),
                            send_counts[peer] * per_element, dtype, peer, stream,
                        )
                    if recv_counts[peer]:
                        comm.recv(
                            cuda_support.device_ptr(tensor_out, recv_offsets[peer]),
                            recv_counts[peer] * per_element, dtype, peer, stream,
                        )

        self._run("alltoall", device, launch, point_to_point=True)

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor,
        counts: Sequence[int],
        op: ReduceOp,
    ) -> None:
        device = cuda_support.tensor_device(tensor_out)
        if self._needs_widening(tensor_out.dtype):
            wide_out = torch.empty(tensor_out.shape, dtype=torch.float32, device=device)
            self.reduce_scatter(tensor_in.float(), wide_out, counts, op)
            tensor_out.copy_(wide_out)
            return
        dtype = self._reduce_type(tensor_out.dtype)
        nccl_op = self._reduce_op(op)
        offsets = cuda_support.block_offsets(counts)
        counts = list(counts)

        def launch(comm: Any, stream: int) -> None:
            if len(set(counts)) == 1:
                comm.reduceScatter(
                    cuda_support.device_ptr(tensor_in), cuda_support.device_ptr(tensor_out),
                    counts[0], dtype, nccl_op, stream,
                )
                return
            # Uneven blocks: one reduce per block, to the rank that keeps it.
            with self._group():
                for root, (count, offset) in enumerate(zip(counts, offsets)):
                    if count == 0:
                        continue
                    source = cuda_support.device_ptr(tensor_in, offset)
                    target = cuda_support.device_ptr(tensor_out) if root == self.rank else source
                    comm.reduce(source, target, count, dtype, nccl_op, root, stream)

        self._run("reduce_scatter", device, launch)

    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        device = cuda_support.tensor_device(tensor_in)
        dtype, per_element = self._move_type(tensor_in)
        count = tensor_in.numel() * per_element

        def launch(comm: Any, stream: int) -> None:
            with self._group():
                comm.send(cuda_support.device_ptr(tensor_out), count, dtype, peer, stream)
                comm.recv(cuda_support.device_ptr(tensor_in), count, dtype, peer, stream)

        self._run("sendrecv", device, launch, point_to_point=True)

    def barrier(self) -> None:
        # NCCL has no barrier: a one-element allreduce that everybody waits for is one.
        device = self._device
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        token = torch.zeros(1, dtype=torch.int32, device=device)
        self.allreduce(token, token, ReduceOp.SUM)

    def free(self) -> None:
        """Destroys the NCCL communicator once its stream has drained. ``ncclCommDestroy``
        blocks while work is in flight, and work waiting for a peer that is gone never
        ends: the stream gets the collective timeout to drain, then the communicator is
        aborted instead."""
        handle = self._handle
        if handle is None:
            return
        if self._stream is not None and self._device is not None:
            with self._cupy.cuda.Device(self._device.index):  # whichever thread frees it
                drained = self._cupy.cuda.Event(disable_timing=True)
                drained.record(self._stream)
                try:
                    self._wait(drained, "the last collectives before freeing", self._device)
                except NCCLError:
                    return  # _wait aborted the communicator (and dropped the handle)
        self._handle = None
        handle.destroy()


def local_communicator(topology: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> NCCLCommunicator:
    """An NCCL communicator of the ranks on this node (``topology.local_comm``)."""
    return NCCLCommunicator(topology.local_comm, timeout_s)


def cross_communicator(topology: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> NCCLCommunicator:
    """An NCCL communicator of this local rank's peers (``topology.cross_comm``)."""
    return NCCLCommunicator(topology.cross_comm, timeout_s)


def single_rank_communicator(timeout_s: float = DEFAULT_TIMEOUT_S) -> NCCLCommunicator:
    """An NCCL communicator of this process alone (BAGUAHVD_NCCL_SINGLE_RANK), which takes
    the whole NCCL path where a group of one would otherwise copy."""
    return NCCLCommunicator(nccl_setup.OneRank(), timeout_s)
