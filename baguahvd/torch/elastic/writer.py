"""A persisted commit in two halves: the commit, taken when ``commit()`` is called, and the
write, which runs on a background thread.

The protocol, for the one :class:`CommitWriter` of a state on the first rank of a host:

1. :meth:`CommitWriter.submit` runs in the training thread and, within the bound of 3,
   waits for no write. It raises the failure of an earlier write, if one failed and was
   not reported yet. It keeps the commit as the newest one: the payload's containers
   rebuilt around its tensors as they are (a state's saved copy is a fresh deep copy at
   every save and is never changed in place afterwards) and, for CUDA tensors, an event
   on each device's current stream, after the copy that made them. A commit that is to
   be written, and that finds no write in flight, starts one; one that finds a write in
   flight waits in memory, and a newer commit replaces it there (it is superseded: never
   written, not even in part). ``write=False`` keeps a commit in memory without asking
   for its write (for ``BAGUAHVD_ELASTIC_PERSIST_EVERY``); such a commit still supersedes
   one that waits for its write, and is written in its place.
2. The write thread, at a low scheduling priority where the system has one (so that the
   training threads keep the cores), takes the newest commit that is to be written.
   It copies the CUDA tensors into pinned host buffers on a stream of its own, after the
   commit's events (the buffers are reused from one write to the next: only this thread
   touches them), then runs :meth:`CheckpointStore.write`: the payload in the commit
   container, hashed with SHA-256 as it is written, fsync, and only then the manifest
   renamed into place, so a commit counts once it is durable and not before (loading
   checks it against the manifest). When it has finished, it takes the newest commit
   that came in meanwhile, if one is to be written, and ends when there is none. So one
   write runs at a time, and whatever the commits' rate, the newest durable commit is
   behind the newest one made by at most the one being written and the one waiting:
   about two write times (longer when every core is busy, as the thread's low priority
   lets training go first).
3. The lag has a bound, ``max_lag_s`` (``BAGUAHVD_ELASTIC_MAX_LAG_SECONDS``): a commit that
   finds a write in flight while the oldest commit asked to be written has waited longer
   than that for itself or a newer one to become durable (it is "owed") waits, after
   taking its place as the newest, until the write in flight ends. Training stops on this
   rank meanwhile, which gives the writer the CPU that its low priority denies it on busy
   cores (raising a thread's priority back takes privileges; waiting does not). The first
   such wait is logged. So at every commit the newest durable commit is at most about
   ``max_lag_s``, two steps and one write (taken with the CPU free) old; a commit that
   finds the owed commits within the bound never waits.
4. A failed write is logged at once, at error level, and raised as
   :class:`CommitWriteError` by the next :meth:`~CommitWriter.submit`,
   :meth:`~CommitWriter.wait` or :meth:`~CommitWriter.flush`; a commit that was waiting
   behind it is dropped. The folder keeps the commits before it.
5. :meth:`~CommitWriter.flush` asks for the write of the newest commit, if it was kept
   in memory only, and waits until it is durable. The thread is not a daemon: a process
   that ends normally writes what it was asked to write first. A process killed during a
   write leaves the previous commit whole (the store renames the manifest last); the next
   write on that host removes the killed writer's leftovers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from baguahvd.common.config import Config
from baguahvd.torch.elastic.store import CheckpointStore

logger = logging.getLogger(__name__)

__all__ = ["CommitWriteError", "CommitWriter", "HostStaging", "PendingCommit"]

_WRITER_NICE = 19
"""The ``nice`` value of the write thread, where threads have their own: on a busy core it
gets about a sixtieth of the time of a training thread (nice 0), and on an idle one all of
it. Writing a commit takes little CPU (SHA-256 and the copy into the page cache; the rest
waits for the disk without the GIL), so on two CPU-bound cores the newest durable commit
of a 100 MB model lagged 1.3-1.4 s (median) at 19 against 0.8-0.9 s at 10, while what a
commit added to a step fell from 72-91 ms to 45-52 ms
(``benchmarks/results/elastic_commit/NOTES.md``, "The writer's priority")."""


class CommitWriteError(RuntimeError):
    """The background write of a commit failed. The elastic folder keeps the commits
    before it, and a restart resumes from the newest of those; the message names the
    commit, the folder and the cause (also chained as ``__cause__``)."""


@dataclasses.dataclass(frozen=True)
class PendingCommit:
    """A commit waiting for its write: its number, its payload (containers of its own,
    tensors shared with the state's saved copy) and, per CUDA device, an event after the
    work that made its tensors there."""

    number: int
    payload: Any
    ready: tuple[tuple[torch.device, torch.cuda.Event], ...] = ()

    @classmethod
    def take(cls, number: int, payload: Any) -> PendingCommit:
        """The commit of ``payload``, taken in the thread (and on the streams) that made it."""
        devices: dict[torch.device, None] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type == "cuda":
                devices[tensor.device] = None
            return tensor

        kept = _map_tensors(payload, keep)
        ready = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            ready.append((device, event))
        return cls(number, kept, tuple(ready))


class HostStaging:
    """The host copy of a commit's CUDA tensors, taken by the write thread: pinned buffers
    reused between writes while the tensors keep their shapes and dtypes, filled on a copy
    stream of its own per device, so that training's streams never wait for them."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stage(self, commit: PendingCommit) -> Any:
        """``commit``'s payload with its CUDA tensors copied into the pinned buffers (the
        previous write's contents are overwritten); returns once the copies are done. Other
        tensors are kept as they are, except those of other devices, copied to the CPU."""
        for device, event in commit.ready:
            self._stream(device).wait_event(event)
        used: list[torch.Tensor] = []

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type == "cpu":
                return tensor
            if tensor.device.type != "cuda":
                return tensor.detach().to("cpu")
            index = len(used)
            buffer = self._buffers[index] if index < len(self._buffers) else None
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.stream(self._stream(tensor.device)):
                buffer.copy_(tensor.detach(), non_blocking=True)
            used.append(buffer)
            return buffer

        staged = _map_tensors(commit.payload, copy)
        self._buffers = used
        for stream in self._streams.values():
            stream.synchronize()
        return staged

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream


def _map_tensors(value: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with its containers rebuilt and ``function`` applied to its tensors."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, dict):
        return type(value)((key, _map_tensors(item, function)) for key, item in value.items())
    if isinstance(value, (list, tuple, set)):
        return type(value)(_map_tensors(item, function) for item in value)
    return value


class CommitWriter:
    """Writes the commits of one host to a :class:`CheckpointStore` on a background thread,
    one at a time, the newest first (see the module's protocol).

    Args:
        store: the elastic folder's store.
        max_lag_s: how long a commit asked to be written may stay owed before commits wait
            for the write in flight (``BAGUAHVD_ELASTIC_MAX_LAG_SECONDS``; the elastic
            state passes its configuration's).
        clock: the monotonic clock, in seconds, that the bound is measured with (tests
            pass one that they step by hand).
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        max_lag_s: float = Config.elastic_max_lag_s,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_lag_s < 0:
            raise ValueError(f"max_lag_s={max_lag_s!r} must not be negative")
        self._store = store
        self._staging = HostStaging()
        self._max_lag_s = max_lag_s
        self._clock = clock
        self._lock = threading.Lock()
        # Notified whenever a write ends, for the commits that the bound makes wait for it.
        self._written = threading.Condition(self._lock)
        # The newest commit not yet taken by the write thread, and whether it is to be
        # written (False: kept in memory only, until flush() or a newer commit).
        self._newest: PendingCommit | None = None
        self._due = False
        # The commit being written; when the oldest commit that its write makes durable
        # was made, and the oldest of those owed that wait for a later write.
        self._writing: PendingCommit | None = None
        self._writing_owed: float | None = None
        self._waiting_owed: float | None = None
        self._thread: threading.Thread | None = None
        self._failure: CommitWriteError | None = None
        self._durable = -1
        self._lag_waits = 0

    @property
    def busy(self) -> bool:
        """Whether a write is in flight or due."""
        with self._lock:
            return self._thread is not None

    @property
    def durable(self) -> int:
        """The newest commit this writer has made durable; -1 before the first."""
        return self._durable

    def holds(self) -> frozenset[int]:
        """The numbers of the commits whose tensors this writer may still read: the one
        being written and the newest (waiting for its write, or kept in memory). It never
        reads the tensors of any other commit again, so their memory may be reused."""
        with self._lock:
            return frozenset(
                commit.number for commit in (self._writing, self._newest) if commit is not None
            )

    @property
    def lag_waits(self) -> int:
        """How many commits waited for the write in flight because of the bound on the
        lag (counted as each wait starts)."""
        return self._lag_waits

    def submit(self, number: int, payload: Any, *, write: bool = True) -> None:
        """Keeps commit ``number`` as the newest, superseding (and taking the place of) one
        that waits for its write, and starts its write unless one is in flight (then it
        waits in memory) or ``write`` is False and it supersedes none (then it stays in
        memory until :meth:`flush` or a newer commit is written). Waits for no write,
        unless the commits owed have waited longer than the bound: then it waits until the
        write in flight ends.

        Raises:
            CommitWriteError: an earlier write failed (this commit is not kept); raised once.
        """
        self._raise_failure()
        commit = PendingCommit.take(number, payload)
        now = self._clock()
        with self._lock:
            in_flight = self._writing
            self._newest = commit
            if write and self._waiting_owed is None:
                self._waiting_owed = now
            self._due = self._due or write
            lag = self._lag(now)
            late = in_flight is not None and lag > self._max_lag_s
            self._start_if_due()
            if late:
                self._lag_waits += 1
        if in_flight is None or not late:
            return
        if self._lag_waits == 1:
            logger.warning(
                "commit %d waits for the write of commit %d: commits asked to be written "
                "have not become durable for %.1f s, more than "
                "BAGUAHVD_ELASTIC_MAX_LAG_SECONDS=%g (the writer's low priority left it too "
                "little CPU); a commit that finds the folder this far behind waits for the "
                "write in flight (said once)",
                number, in_flight.number, lag, self._max_lag_s,
            )
        with self._lock:
            while self._writing is in_flight:
                self._written.wait()
        self._raise_failure()

    def wait(self) -> None:
        """Waits until every commit asked to be written (not one kept in memory only) is
        durable.

        Raises:
            CommitWriteError: a write failed; raised once.
        """
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        self._raise_failure()

    def flush(self) -> None:
        """Makes the newest commit durable: writes it if it was kept in memory only, and
        waits for it (:meth:`wait`)."""
        with self._lock:
            if self._newest is not None:
                if self._waiting_owed is None:
                    self._waiting_owed = self._clock()
                self._due = True
                self._start_if_due()
        self.wait()

    def _lag(self, now: float) -> float:
        """How long the oldest commit owed has waited to become durable (0: none is owed)."""
        owed = [t for t in (self._writing_owed, self._waiting_owed) if t is not None]
        return now - min(owed) if owed else 0.0

    def _start_if_due(self) -> None:
        if self._thread is None and self._due and self._failure is None:
            self._thread = threading.Thread(target=self._run, name="baguahvd-commit-writer")
            self._thread.start()

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._lock:
                commit = self._newest if self._due and self._failure is None else None
                if commit is None:
                    self._thread = None
                    return
                self._newest, self._due = None, False
                self._writing, self._writing_owed = commit, self._waiting_owed
                self._waiting_owed = None
            self._write(commit)

    def _write(self, commit: PendingCommit) -> None:
        written, failure = False, None
        try:
            self._store.write(commit.number, self._staging.stage(commit))
            written = True
        except Exception as error:  # noqa: BLE001 - reported by the next call
            before = (
                f"commit {self._durable} is the newest this process made durable"
                if self._durable >= 0
                else "this process made no commit durable yet"
            )
            failure = CommitWriteError(
                f"the background write of commit {commit.number} to {self._store.folder} "
                f"failed ({type(error).__name__}: {error}); the folder keeps the commits "
                f"before it ({before}), and a restart resumes from the newest intact one"
            )
            failure.__cause__ = error
            logger.error("%s", failure)
        finally:
            # Whatever ended the write (even what ends the thread), a commit waiting for
            # it must not wait on.
            with self._lock:
                if written:
                    self._durable = commit.number
                elif failure is not None:
                    self._failure = failure
                    if self._due:
                        self._newest, self._due, self._waiting_owed = None, False, None
                self._writing, self._writing_owed = None, None
                self._written.notify_all()


def _lower_priority() -> None:
    """Gives the calling thread the writer's low scheduling priority, where threads have
    their own (Linux); elsewhere it keeps its priority."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICE)
    except OSError as error:
        logger.debug("the commit writer keeps its priority: %s", error)
