"""A persisted commit in two halves: the host copy, taken when ``commit()`` is called, and
the write, which runs on a background thread.

The protocol, for the one :class:`CommitWriter` of a state on the first rank of a host:

1. :meth:`CommitWriter.submit` runs in the training thread. It waits for the previous
   write only if that one has not finished (so at most one write is in flight, and the
   pinned buffers are free again), raises that write's failure if it failed, takes the
   host copy of the payload and starts the write. The host copy rebuilds the payload's
   containers, keeps its CPU tensors as they are (a state's saved copy is a fresh deep
   copy at every save and is never changed in place afterwards) and copies its CUDA
   tensors into pinned host buffers that are reused from one commit to the next, queued on
   each tensor's current stream and marked by an event.
2. The write thread waits for those events, then runs :meth:`CheckpointStore.write`:
   ``torch.save``, SHA-256, fsync, and only then the manifest renamed into place, so a
   commit counts once it is durable and not before (loading checks it against the
   manifest).
3. A failed write is logged at once, at error level, and raised as
   :class:`CommitWriteError` by the next :meth:`~CommitWriter.submit` or
   :meth:`~CommitWriter.wait`. The folder keeps the commits before it.
4. The thread is not a daemon: a process that ends normally finishes the write first. A
   process killed during a write leaves the previous commit whole (the store renames the
   manifest last); the next write on that host removes the killed writer's leftovers.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch

from baguahvd.torch.elastic.store import CheckpointStore

logger = logging.getLogger(__name__)

__all__ = ["CommitWriteError", "CommitWriter", "HostStaging", "StagedCommit"]


class CommitWriteError(RuntimeError):
    """The background write of a commit failed. The elastic folder keeps the commits
    before it, and a restart resumes from the newest of those; the message names the
    commit, the folder and the cause (also chained as ``__cause__``)."""


@dataclasses.dataclass(frozen=True)
class StagedCommit:
    """A payload in host memory, ready to be written once its copies have finished."""

    payload: Any
    copies: tuple[torch.cuda.Event, ...] = ()

    def wait_copied(self) -> None:
        """Blocks until the device-to-host copies queued for the payload have finished."""
        for event in self.copies:
            event.synchronize()


class HostStaging:
    """The host copy of a commit: pinned buffers for its CUDA tensors, reused between
    commits while the tensors keep their shapes and dtypes."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def stage(self, payload: Any) -> StagedCommit:
        """Copies ``payload``'s containers, and its CUDA tensors into the pinned buffers.

        The buffers of the previous commit are overwritten: its write must have finished.
        """
        used: list[torch.Tensor] = []
        devices: dict[torch.device, None] = {}
        copied = self._copy(payload, used, devices)
        self._buffers = used
        events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return StagedCommit(copied, tuple(events))

    def _copy(self, value: Any, used: list[torch.Tensor], devices: dict[torch.device, None]) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu":
                return value
            if value.device.type != "cuda":
                return value.detach().to("cpu")
            index = len(used)
            buffer = self._buffers[index] if index < len(self._buffers) else None
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            buffer.copy_(value.detach(), non_blocking=True)
            used.append(buffer)
            devices[value.device] = None
            return buffer
        if isinstance(value, dict):
            return type(value)(
                (key, self._copy(item, used, devices)) for key, item in value.items()
            )
        if isinstance(value, (list, tuple, set)):
            return type(value)(self._copy(item, used, devices) for item in value)
        return value


class CommitWriter:
    """Writes the commits of one host to a :class:`CheckpointStore`, one at a time, on a
    background thread (see the module's protocol).

    Args:
        store: the elastic folder's store.
    """

    def __init__(self, store: CheckpointStore) -> None:
        self._store = store
        self._staging = HostStaging()
        self._thread: threading.Thread | None = None
        self._failure: CommitWriteError | None = None
        self._durable = -1

    @property
    def busy(self) -> bool:
        """Whether a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def durable(self) -> int:
        """The newest commit this writer has made durable; -1 before the first."""
        return self._durable

    def submit(self, number: int, payload: Any) -> None:
        """Takes the host copy of commit ``number`` and starts writing it.

        Raises:
            CommitWriteError: the previous write failed (this commit is not written).
        """
        self.wait()
        staged = self._staging.stage(payload)
        thread = threading.Thread(
            target=self._write, args=(number, staged), name=f"baguahvd-commit-{number}"
        )
        thread.start()
        self._thread = thread

    def wait(self) -> None:
        """Waits for the write in flight, if any.

        Raises:
            CommitWriteError: the last write failed; raised once.
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _write(self, number: int, staged: StagedCommit) -> None:
        try:
            staged.wait_copied()
            self._store.write(number, staged.payload)
        except Exception as error:  # noqa: BLE001 - reported by the next submit() or wait()
            before = (
                f"commit {self._durable} is the newest this process made durable"
                if self._durable >= 0
                else "this process made no commit durable yet"
            )
            failure = CommitWriteError(
                f"the background write of commit {number} to {self._store.folder} failed "
                f"({type(error).__name__}: {error}); the folder keeps the commits before it "
                f"({before}), and a restart resumes from the newest intact one"
            )
            failure.__cause__ = error
            logger.error("%s", failure)
            self._failure = failure
        else:
            self._durable = number
