"""Request intake: the queue between user threads and the engine thread.

A user thread hands a described request (:mod:`~baguahvd.engine.submission`) to
:meth:`RequestQueue.put`, its one call here; a name may be in flight once at a time
(unnamed requests are numbered in submission order, so theirs never clash). The
engine thread takes the whole queue at the start of a cycle (:meth:`RequestQueue.take`). A
placeholder (a collective that failed its local checks, see :mod:`~baguahvd.engine.messages`)
holds its name like any request, but a request of the same name submitted meanwhile (the
call retried after the error) is not a duplicate: it waits in the intake until the
placeholder is done, and is queued then, as the name's next round.

A burst of submissions (a backward pass, a loop of async calls) is negotiated as one: the
engine waits until a thread blocks on a handle (the burst is over: it submits nothing more
meanwhile), or nothing has been submitted for half a millisecond, or five cycle times have
passed (see :meth:`RequestQueue.let_burst_finish`). A request that runs alone (``fuse=False``:
a gradient bucket) ends the burst when it arrives: nothing would be fused with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from baguahvd.common.exceptions import DuplicateNameError
from baguahvd.engine.messages import UNNAMED_PREFIX
from baguahvd.engine.requests import Request

_now = time.perf_counter

# A burst of submissions is over once its thread has submitted nothing for this long ...
QUIET_S = 5e-4
# ... or this many cycle times after it began, whichever comes first.
BURST_CYCLES = 5


class RequestQueue:
    """The queue between user threads and the engine thread (see module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Event()
        """Set when there is something for the engine thread to do."""
        self.flush = threading.Event()
        """Set when a thread blocks on a handle: the burst being submitted is over."""
        self._wakes = (self.flush,)
        self._blocking_wakes = (self.flush, self.wake)
        """What a handle sets when its caller waits (:attr:`Handle.wakes`): a blocking
        request's caller ends the burst and starts the cycle."""
        self._queue: list[Request] = []
        self._inflight: dict[tuple[int, str], Request] = {}
        """The request holding each name: the name is free again once that request's handle
        is done, whoever completed it, so nothing hands finished requests back here."""
        self._kept = 0
        """Names held after the last pruning of :attr:`_inflight`."""
        self._retries: dict[tuple[int, str], Request] = {}
        """Requests waiting for a placeholder of their name to be done."""
        self._last_arrival = 0.0

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
        when it does (its handle's ``wakes``), with the submitting thread already off the
        GIL, rather than now, when it would wake only to wait for the GIL and then for the
        flush. Should the caller not wait, the next cycle (``cycle_time_ms``) takes it.
        """
        request.handle.wakes = self._blocking_wakes if blocking else self._wakes
        ident = request.ident
        with self.lock:
            error = stopped()
            if error is not None:
                raise error
            # Unnamed requests are numbered in submission order, so never a duplicate nor
            # held again: not kept in _inflight.
            if not ident[1].startswith(UNNAMED_PREFIX):
                holder = self._inflight.get(ident)
                # The common case inline: a name last held by a request that is done, with
                # no retry waiting, is free (the new request replaces the old in _inflight).
                if holder is not None and (self._retries or not holder.handle.done()):
                    holder = self._holder(ident)
                    if holder is not None:
                        if (not holder.meta.failure or ident in self._retries
                                or request.meta.failure):
                            raise DuplicateNameError(request.meta.name)
                        self._retries[ident] = request
                        return
                self._inflight[ident] = request
            queue = self._queue
            queue.append(request)  # _enqueue inline: per request
            self._last_arrival = _now()
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

    def _alone(self) -> bool:
        """Whether the queue is empty or its newest request runs alone (``fuse=False``: a
        gradient bucket, see :mod:`baguahvd.torch.buckets`): a longer burst would fuse
        nothing with it, and its transfer should start now."""
        queue = self._queue
        return not queue or not queue[-1].meta.fuse

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
        if self._alone():
            return
        start = time.perf_counter()
        limit = BURST_CYCLES * cycle_time_ms / 1000.0
        flush = self.flush
        while not flush.is_set():
            if self._alone():
                return
            now = time.perf_counter()
            since = now - self._last_arrival
            if since >= QUIET_S or now - start >= limit:
                return
            flush.wait(min(QUIET_S - since, limit - (now - start)))
