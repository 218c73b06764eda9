"""Request intake: how user threads hand collectives to the engine thread.

A user thread describes a call once, as a :class:`~baguahvd.engine.requests.Request` whose
:class:`~baguahvd.engine.messages.RequestMeta` names it (:meth:`RequestQueue.name`: named
requests by ``label.name``, unnamed ones by their order per process set, ``noname.N``) and
holds what the ranks compare (:func:`describe_tensors`), and appends it to the queue; a name
may be in flight once at a time. The engine thread takes the whole queue at the start of a
cycle. A placeholder (a collective that failed its local checks, see
:mod:`~baguahvd.engine.messages`) holds its name like any request, but a request of the same
name submitted meanwhile (the call retried after the error) is not a duplicate: it waits in
the intake until the placeholder is done, and is queued then, as the name's next round.

A burst of submissions (a backward pass, a loop of async calls) is negotiated as one: the
engine waits until a thread blocks on a handle (the burst is over: it submits nothing more
meanwhile), or nothing has been submitted for half a millisecond, or five cycle times have
passed (see :meth:`RequestQueue.let_burst_finish`).

With ``BAGUAHVD_CHECK_CALL_SITES`` an unnamed request also records where the user called it
(:func:`call_site`), so that rank 0 can tell ranks that pair unnamed collectives from
different lines.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

from baguahvd.backends import cuda_support
from baguahvd.common.exceptions import CudaGraphCaptureError, DuplicateNameError
from baguahvd.engine.messages import (
    DTYPES,
    JOIN_KEY,
    UNNAMED_PREFIX,
    OpType,
    dtype_name,
    is_unnamed,
)
from baguahvd.engine.requests import Request

# A burst of submissions is over once its thread has submitted nothing for this long ...
QUIET_S = 5e-4
# ... or this many cycle times after it began, whichever comes first.
BURST_CYCLES = 5

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# Frames in these folders are the library's, not the user's call.
_LIBRARY_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def call_site() -> str:
    """``file:line`` of the innermost frame outside baguahvd and torch: the user's call."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARY_DIRS):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def describe_tensors(
    inputs: Sequence[torch.Tensor], label: str
) -> tuple[str, tuple[tuple[int, ...], ...], str]:
    """The dtype name, the shapes and the device kind (``CPU`` or ``GPU``) of a call's
    tensors, as the ranks compare them.

    Raises:
        CudaGraphCaptureError: CUDA tensors were submitted while this thread's current
            stream captures a CUDA graph; refused before the call is named, so that the
            placeholder of the failed call takes the name the call would have had.
    """
    if not inputs:
        return "", (), "CPU"
    first = inputs[0]
    # The kind only, as Horovod compares it: each rank drives its own GPU (usually
    # cuda:<local_rank>), so indices differ across ranks of one collective.
    if first.is_cuda:
        device = "GPU"
        if cuda_support.stream_capturing():
            raise CudaGraphCaptureError(label)
    else:
        device = "CPU"
    dtype = _DTYPE_NAMES.get(first.dtype) or dtype_name(first.dtype)
    if len(inputs) == 1:
        return dtype, (tuple(first.shape),), device
    return dtype, tuple(tuple(t.shape) for t in inputs), device


class ThreadActivity(threading.local):
    """Per submitting thread: the timeline activity tagging the requests it submits now (a
    class default: looking up a thread-local's missing attribute raises and catches)."""

    name: str | None = None


class RequestQueue:
    """The queue between user threads and the engine thread (see module docstring)."""

    def __init__(self, rank: int, check_sites: bool = False) -> None:
        self.rank = rank
        self.check_sites = check_sites
        """Record the call site of each unnamed request (BAGUAHVD_CHECK_CALL_SITES)."""
        self.lock = threading.Lock()
        self.wake = threading.Event()
        """Set when there is something for the engine thread to do."""
        self.flush = threading.Event()
        """Set when a thread blocks on a handle: the burst being submitted is over."""
        self._queue: list[Request] = []
        self._inflight: dict[tuple[int, str], Request] = {}
        """The request holding each name: the name is free again once that request's handle
        is done, whoever completed it, so nothing hands finished requests back here."""
        self._kept = 0
        """Names held after the last pruning of :attr:`_inflight`."""
        self._retries: dict[tuple[int, str], Request] = {}
        """Requests waiting for a placeholder of their name to be done."""
        self._noname: dict[int, int] = {}
        self._last_arrival = 0.0

    def skip_unnamed(self, process_set_id: int, key: str) -> None:
        """Counts an agreed unnamed collective this rank submitted nothing for.

        A rank that has joined takes part in the others' collectives without submitting
        them; its count of unnamed requests must still advance past each one, or its next
        unnamed request after the join would pair with one the others already ran (or
        failed). Named keys are ignored.
        """
        if not is_unnamed(key):
            return
        number = int(key[len(UNNAMED_PREFIX):])
        with self.lock:
            if self._noname.get(process_set_id, 0) <= number:
                self._noname[process_set_id] = number + 1

    def name(
        self, op: OpType, label: str, process_set_id: int, name: str | None
    ) -> tuple[str, str, str]:
        """The negotiation key, the displayed name and the call site (for unnamed requests
        with BAGUAHVD_CHECK_CALL_SITES, else empty) of a call (see module docstring)."""
        if name is not None and op != OpType.JOIN:
            key = f"{label}.{name}"
            return key, key, ""
        if op == OpType.JOIN:
            return JOIN_KEY, JOIN_KEY, ""
        site = call_site() if self.check_sites else ""
        with self.lock:
            count = self._noname.get(process_set_id, 0)
            self._noname[process_set_id] = count + 1
        return f"{UNNAMED_PREFIX}{count}", f"{label}.{UNNAMED_PREFIX}{count}", site

    def check_unique(self, request: Request) -> None:
        """Raises DuplicateNameError when a request of the same name is in flight."""
        with self.lock:
            if self._holder(request.ident) is not None:
                raise DuplicateNameError(request.meta.name)

    def put(
        self, request: Request, stopped: Callable[[], BaseException | None],
        blocking: bool = False,
    ) -> None:
        """Queues ``request`` for the engine thread; raises ``stopped()`` when not None.

        A ``blocking`` request's caller waits for it at once: the engine thread is woken
        when it does (its handle's ``on_wait``), with the submitting thread already off the
        GIL, rather than now, when it would wake only to wait for the GIL and then for the
        flush. Should the caller not wait, the next cycle (``cycle_time_ms``) takes it.
        """
        request.handle.on_wait = self._blocked if blocking else self.flush.set
        with self.lock:
            error = stopped()
            if error is not None:
                raise error
            ident = request.ident
            holder = self._holder(ident)
            if holder is not None:
                if not holder.meta.failure or ident in self._retries or request.meta.failure:
                    raise DuplicateNameError(request.meta.name)
                self._retries[ident] = request
                return
            self._enqueue(request)
            queue = self._queue
        # The engine takes the whole queue at once: only the first request of a batch needs
        # to wake it (see let_burst_finish for the rest).
        if len(queue) == 1 and not blocking:
            self.wake.set()

    def _holder(self, ident: tuple[int, str]) -> Request | None:
        """The request in flight under ``ident``, or None when the name is free: once the
        holder is done, a retry that waited for it takes the name (lock held)."""
        holder = self._inflight.get(ident)
        if holder is None or not holder.handle.done():
            return holder
        del self._inflight[ident]
        retry = self._retries.pop(ident, None)
        if retry is not None:
            self._enqueue(retry)
        return retry

    def _enqueue(self, request: Request) -> None:
        self._inflight[request.ident] = request
        self._queue.append(request)
        self._last_arrival = time.perf_counter()

    def _blocked(self) -> None:
        """A blocking request's caller waits: its burst is over, and the cycle starts."""
        self.flush.set()
        self.wake.set()

    def take(self) -> list[Request]:
        """Everything queued so far (engine thread, at the start of a cycle)."""
        self.flush.clear()
        with self.lock:
            new, self._queue = self._queue, []
        return new

    def release_retries(self) -> None:
        """Queues the retries whose placeholder is done, and forgets the names of finished
        requests now and then (engine thread, after each cycle)."""
        with self.lock:
            if self._retries:
                queued = len(self._queue)
                for ident in list(self._retries):
                    self._holder(ident)
                if len(self._queue) > queued:
                    self.wake.set()
            if len(self._inflight) > 2 * self._kept + 64:
                self._inflight = {
                    ident: request for ident, request in self._inflight.items()
                    if not request.handle.done() or ident in self._retries
                }
                self._kept = len(self._inflight)

    def drain(self) -> list[Request]:
        """Takes every queued request and forgets every name in flight (the engine stops)."""
        with self.lock:
            queued, self._queue = [*self._queue, *self._retries.values()], []
            self._inflight.clear()
            self._retries.clear()
        return queued

    def wake_up(self) -> None:
        """Starts the next cycle now (the job is ending)."""
        self.wake.set()
        self.flush.set()

    def let_burst_finish(self, cycle_time_ms: float) -> None:
        """Waits for a burst of submissions to end before negotiating it, so that it is
        fused into one cycle and the engine thread does not compete with the submitting
        thread for the GIL meanwhile (see module docstring).

        The engine waits on the flush event, which a thread that starts waiting for a handle
        sets (the cycle that takes the queue clears it), and wakes up only for the
        deadlines: every wake-up takes the GIL from the submitting thread.
        """
        if not self._queue:
            return
        start = time.perf_counter()
        limit = BURST_CYCLES * cycle_time_ms / 1000.0
        flush = self.flush
        while not flush.is_set():
            now = time.perf_counter()
            since = now - self._last_arrival
            if since >= QUIET_S or now - start >= limit:
                return
            flush.wait(min(QUIET_S - since, limit - (now - start)))
