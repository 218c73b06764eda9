"""Creating an NCCL communicator with a deadline instead of an open-ended wait.

Creation is collective and has three steps, each of which waits for the peers:

1. the set's first rank makes an NCCL unique id and the set's id channel carries it to the
   members as 128 bytes (:func:`exchange_unique_id`): MPI's non-blocking ``Ibcast`` in MPI
   jobs, the job's store in gloo jobs (:class:`baguahvd.backends.gloo.StoreIdChannel`);
   either is polled, so a member that never arrives cannot hold the others;
2. ``ncclCommInitRank`` builds the communicator (NCCL's bootstrap: every member must call it);
3. a one-byte allreduce warms the communicator up: NCCL connects the peers lazily at the
   first collective, and that setup blocks the calling thread.

CuPy's bindings offer no non-blocking communicator (``ncclCommInitRankConfig`` with
``blocking = 0``, NCCL 2.14 and later, is not exposed as of CuPy 13), and turning it on for
the whole process (``NCCL_COMM_BLOCKING=0``) would make CuPy read NCCL's ``ncclInProgress``
answers as failures. So steps 2 and 3 run on a helper thread: CuPy releases the GIL inside
NCCL, and the calling (engine) thread polls the helper, then the warm-up's completion event,
with the deadline, NCCL's asynchronous error state and the engine's stop state. When time
runs out the communicator is aborted (``ncclCommAbort``, which also releases a helper stuck
in the connection setup) and :class:`NCCLTimeoutError` names the step that did not finish.
A helper still inside ``ncclCommInitRank`` has no communicator to abort yet: it is left
behind (a daemon thread) and aborts the communicator itself if NCCL ever returns one.

NCCL 2.22 and later also connect a collective's algorithm lazily, at its first use
(``NCCL_RUNTIME_CONNECT=1``, their default), which would block the engine thread inside a
launch. Unless the user set it, :func:`connect_at_creation` turns that off before the first
communicator, so every collective connection is made inside ``ncclCommInitRank``, on the
helper thread, under the deadline. Point-to-point connections (alltoall, sendrecv) are set up
at their first use, which :class:`~baguahvd.backends.nccl.NCCLCommunicator` runs on a helper
thread under the collective's own deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from baguahvd.backends import cuda_support
from baguahvd.backends.cuda_support import NCCLError, NCCLTimeoutError
from baguahvd.kernels import cupy_api

logger = logging.getLogger(__name__)

UNIQUE_ID_BYTES = cupy_api.UNIQUE_ID_BYTES

_FIRST_POLL_S = 1e-4
_LONGEST_POLL_S = 1e-2


class _Watch:
    """Polls the steps of one creation against one deadline (see module docstring)."""

    def __init__(
        self,
        what: str,
        timeout_s: float,
        stopped: Callable[[], BaseException | None] | None,
    ) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.stopped = stopped
        self.handle: Any = None
        """The NCCL communicator once it exists: checked for errors, aborted on failure."""
        self.nccl_error: type[Exception] = RuntimeError

    def until(self, finished: Callable[[], bool], step: str) -> None:
        """Returns once ``finished()``; raises if the deadline passes, NCCL reports an
        error or the engine stops first (aborting the communicator if there is one)."""
        delay = _FIRST_POLL_S
        while not finished():
            self._check_async_error(step)
            stopped = self.stopped() if self.stopped is not None else None
            if stopped is not None:
                self.fail(NCCLError(
                    f"{self.what} was abandoned during {step} because the engine stopped: "
                    f"{stopped}"
                ))
            if time.monotonic() >= self.deadline:
                self.fail(NCCLTimeoutError(
                    f"{self.what}: {step} did not finish within {self.timeout_s:g} s "
                    "(BAGUAHVD_NCCL_TIMEOUT_SECONDS); a peer may have died, or not reached "
                    "its first collective on this process set"
                ))
            time.sleep(delay)
            delay = min(delay * 2, _LONGEST_POLL_S)

    def _check_async_error(self, step: str) -> None:
        check = getattr(self.handle, "check_async_error", None)
        if check is None:
            return
        try:
            check()
        except self.nccl_error as exc:
            self.fail(NCCLError(f"{self.what} failed during {step}: {exc}"))

    def fail(self, error: NCCLError) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            abort_communicator(handle)
            raise type(error)(f"{error}. The NCCL communicator was aborted.")
        raise error


class _Helper(threading.Thread):
    """Steps 2 and 3 of the module docstring, off the calling thread."""

    def __init__(
        self, cupy: Any, device_index: int, size: int, unique_id: bytes, rank: int
    ) -> None:
        super().__init__(name="baguahvd-nccl-setup", daemon=True)
        self.cupy = cupy
        self.device_index = device_index
        self.size, self.unique_id, self.rank = size, unique_id, rank
        self.handle: Any = None
        self.stream: Any = None
        self.warmed: Any = None
        """Completion event of the warm-up allreduce."""
        self.scratch: Any = None
        self.error: BaseException | None = None
        self.created = threading.Event()
        self.lock = threading.Lock()
        self.abandoned = False

    def run(self) -> None:
        cupy = self.cupy
        nccl = cupy.cuda.nccl
        # NCCL's setup allocates device memory, which would break a user's graph capture.
        cuda_support.relax_capture_mode()
        try:
            cupy.cuda.Device(self.device_index).use()
            handle = cupy_api.new_communicator(nccl, self.size, self.unique_id, self.rank)
            with self.lock:
                if self.abandoned:
                    abort_communicator(handle)
                    return
                self.handle = handle
            self.created.set()
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.scratch = cupy.cuda.alloc(1)
            handle.allReduce(
                self.scratch.ptr, self.scratch.ptr, 1, nccl.NCCL_UINT8, nccl.NCCL_SUM,
                self.stream.ptr,
            )
            warmed = cupy.cuda.Event(disable_timing=True)
            warmed.record(self.stream)
            self.warmed = warmed
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        finally:
            self.created.set()


class OneRank:
    """The MPI side of a one-rank NCCL communicator, which needs no MPI: this process is
    the set's only member and its first rank."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj


def exchange_unique_id(comm: Any, rank: int, nccl: Any, watch: _Watch) -> bytes:
    """The set's first rank makes the unique id; ``comm`` carries it to the members as 128
    bytes, polled against ``watch``: through its own ``start_unique_id`` where it has one
    (an id channel: ``start_unique_id(id or None)`` returns a poll that answers the id once
    it arrived, else None), else MPI's ``Ibcast``, else a blocking ``bcast``."""
    unique_id = cupy_api.unique_id_bytes(nccl.get_unique_id()) if rank == 0 else None
    start = getattr(comm, "start_unique_id", None)
    if start is not None:
        poll = start(unique_id)
        received: list[bytes] = []

        def arrived() -> bool:
            if not received:
                value = poll()
                if value is not None:
                    received.append(value)
            return bool(received)

        watch.until(arrived, "the exchange of the NCCL unique id")
        return cupy_api.unique_id_bytes(received[0])
    if not hasattr(comm, "Ibcast"):
        logger.debug("this MPI communicator has no Ibcast: the unique id is broadcast blocking")
        return cupy_api.unique_id_bytes(comm.bcast(unique_id, root=0))
    buffer = bytearray(UNIQUE_ID_BYTES)
    if unique_id is not None:
        buffer[:] = unique_id
    request = comm.Ibcast(buffer, root=0)
    watch.until(request.Test, "the MPI broadcast of the NCCL unique id")
    return bytes(buffer)


RUNTIME_CONNECT = "NCCL_RUNTIME_CONNECT"


def connect_at_creation(environ: dict[str, str] | None = None) -> None:
    """Makes NCCL connect every collective at communicator creation (see the module
    docstring), unless the user chose otherwise. NCCL reads its environment when the process
    makes its first communicator; older NCCLs ignore the variable."""
    target = os.environ if environ is None else environ
    if RUNTIME_CONNECT not in target:
        target[RUNTIME_CONNECT] = "0"


def create(
    cupy: Any,
    comm: Any,
    rank: int,
    size: int,
    device_index: int,
    timeout_s: float,
    stopped: Callable[[], BaseException | None] | None = None,
) -> tuple[Any, Any]:
    """Creates and warms up the NCCL communicator of this member (see module docstring);
    returns it and the CUDA stream it runs on.

    Raises:
        NCCLTimeoutError: a step did not finish within ``timeout_s``.
        NCCLError: NCCL failed, or the engine stopped while creation waited.
    """
    nccl = cupy.cuda.nccl
    connect_at_creation()
    watch = _Watch(
        f"creating the NCCL communicator of {size} ranks on cuda:{device_index}",
        timeout_s, stopped,
    )
    watch.nccl_error = nccl.NcclError
    unique_id = exchange_unique_id(comm, rank, nccl, watch) if size > 1 else (
        cupy_api.unique_id_bytes(nccl.get_unique_id())
    )
    logger.debug(
        "CuPy's NCCL bindings create blocking communicators only (no "
        "ncclCommInitRankConfig): ncclCommInitRank and the warm-up run on a helper thread "
        "watched with a %g s deadline", timeout_s,
    )
    helper = _Helper(cupy, device_index, size, unique_id, rank)
    helper.start()
    try:
        watch.until(helper.created.is_set, "ncclCommInitRank")
    except NCCLError:
        with helper.lock:
            helper.abandoned = True
            if helper.handle is not None:
                abort_communicator(helper.handle)
        raise
    watch.handle = helper.handle
    _raise_from(helper, watch, "ncclCommInitRank")
    watch.until(lambda: not helper.is_alive(), "the connection setup of the first allreduce")
    _raise_from(helper, watch, "the connection setup of the first allreduce")
    watch.until(lambda: bool(helper.warmed.done), "the first allreduce")
    return helper.handle, helper.stream


def _raise_from(helper: _Helper, watch: _Watch, step: str) -> None:
    error = helper.error
    if error is None:
        return
    if isinstance(error, watch.nccl_error):
        try:
            watch.fail(NCCLError(f"{watch.what} failed during {step}: {error}"))
        except NCCLError as named:
            raise named from error
    raise error


ABORT_WAIT_S = 1.0
"""How long an abort is waited for before the caller goes on without it (see
:func:`abort_communicator`)."""


def abort_communicator(handle: Any) -> None:
    """Aborts the NCCL communicator ``handle`` (``ncclCommAbort``, which also ends its kernels
    still waiting on peers) on a thread of its own, waiting for it at most
    :data:`ABORT_WAIT_S`.

    The abort frees the communicator's device memory, and that waits for the work queued on
    the device: behind a producer kernel that has not finished (seen on an H200: a stream
    held past the NCCL deadline), it returns only when that kernel ends. Waiting for it
    would hold back the error that explains the timeout, so the caller goes on and the
    abort finishes on its own."""
    finished = threading.Event()

    def run() -> None:
        try:
            handle.abort()
        except (AttributeError, RuntimeError) as exc:
            # NCCL older than 2.4 has no abort; its kernels may stay resident.
            logger.error("could not abort the NCCL communicator: %s", exc)
        finally:
            finished.set()

    threading.Thread(target=run, name="baguahvd-nccl-abort", daemon=True).start()
    wait_s = ABORT_WAIT_S
    if not finished.wait(wait_s):
        logger.error(
            "the NCCL communicator's abort is still waiting for the device after %g s (work "
            "queued before the collective has not finished); going on without it", wait_s)

