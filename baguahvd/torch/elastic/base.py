"""Elastic training: states that survive a restart, and the retry loop around training.

Horovod re-forms its Gloo ring inside the running processes. baguahvd runs on MPI, whose
world cannot shrink or grow in place, so it recovers by restarting the job instead:

1. ``state.commit()`` keeps a copy of the state in memory on every rank (``save()``) and,
   when ``BAGUAHVD_ELASTIC_DIR`` is set (``baguahvdrun --elastic`` sets it), persists that
   copy to the folder: the first rank of every host writes ``commit-<n>.<host>.pt``
   atomically and removes its older commits.
2. When a rank dies or raises, the job ends (see the reliability section of the README)
   and ``baguahvdrun --elastic`` launches it again, possibly on other hosts.
3. In the new job, :func:`run_fn`'s wrapper finds the newest commit that any rank can see,
   loads it into rank 0's state (sent over by a rank that sees it when rank 0's host has
   no copy), runs the reset callbacks, and syncs every rank from rank 0 before calling the
   training function again. Training resumes exactly at the
   last commit: no step is lost and none is applied twice.

When the launcher's host discovery reports a change, it writes a notice into the folder;
the next ``commit()`` sees it on rank 0, every rank raises :class:`HostsUpdatedInterrupt`
and the wrapper ends the job with :data:`~baguahvd.common.elastic_protocol.RESIZE_EXIT_CODE`
so that the launcher relaunches it on the new hosts at once.
"""

from __future__ import annotations

import copy
import enum
import functools
import json
import logging
import os
import queue
import re
import socket
import tempfile
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from baguahvd.common import elastic_protocol as protocol
from baguahvd.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from baguahvd.runtime.state import runtime

logger = logging.getLogger(__name__)

_Result = TypeVar("_Result")

_FORMAT = 1
_COMMIT_FILE = re.compile(r"^commit-(\d+)\.(.+)\.pt$")


class HostUpdateResult(enum.IntFlag):
    """How the host set changed (Horovod's values)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


_RESULTS = {
    protocol.HOSTS_REMOVED: HostUpdateResult.removed,
    protocol.HOSTS_ADDED: HostUpdateResult.added,
    protocol.HOSTS_MIXED: HostUpdateResult.mixed,
}


class CheckpointStore:
    """The commits of one host in the elastic folder.

    Files are named ``commit-<n>.<host>.pt``; ``n`` counts the commits of the job, so the
    newest commit is found from the names alone. A file is written under a temporary name
    and renamed, so a rank killed while writing leaves the previous commit intact.

    Args:
        folder: the elastic folder (created when missing).
        host: this host's name, as it appears in the file names.
    """

    def __init__(self, folder: str, host: str | None = None) -> None:
        self.folder = folder
        self.host = _safe_name(host or socket.gethostname())
        os.makedirs(folder, exist_ok=True)

    def commits(self) -> dict[int, str]:
        """Every complete commit in the folder (of any host): number → file path."""
        found: dict[int, str] = {}
        try:
            names = sorted(os.listdir(self.folder))
        except FileNotFoundError:
            return found
        for name in names:
            match = _COMMIT_FILE.match(name)
            if match:
                found.setdefault(int(match.group(1)), os.path.join(self.folder, name))
        return found

    def newest(self) -> int:
        """The number of the newest commit in the folder, -1 when there is none."""
        return max(self.commits(), default=-1)

    def write(self, number: int, payload: Any) -> str:
        """Persists commit ``number`` of this host and removes its older ones."""
        path = os.path.join(self.folder, f"commit-{number}.{self.host}.pt")
        descriptor, temporary = tempfile.mkstemp(prefix=".commit-", dir=self.folder)
        try:
            with os.fdopen(descriptor, "wb") as stream:
                torch.save({"format": _FORMAT, "commit": number, "payload": payload}, stream)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, path)
        except BaseException:
            _remove(temporary)
            raise
        for older, older_path in self.commits().items():
            if older < number and older_path.endswith(f".{self.host}.pt"):
                _remove(older_path)
        return path

    def read(self, number: int) -> Any:
        """Loads the payload of commit ``number`` (tensors on the CPU)."""
        path = self.commits().get(number)
        if path is None:
            raise FileNotFoundError(f"commit {number} is not in {self.folder}")
        record = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(record, dict) or record.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a baguahvd elastic commit")
        return record["payload"]

    def hosts_notice(self) -> tuple[int, HostUpdateResult]:
        """The newest host-change notice of the launcher: (version, what changed)."""
        path = os.path.join(self.folder, protocol.HOSTS_NOTICE_FILE)
        try:
            with open(path, encoding="utf-8") as stream:
                notice = json.load(stream)
            version = int(notice["version"])
            result = _RESULTS.get(str(notice.get("result")), HostUpdateResult.mixed)
        except FileNotFoundError:
            return 0, HostUpdateResult.no_update
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring an unreadable host notice %s: %s", path, error)
            return 0, HostUpdateResult.no_update
        return version, result


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text) or "host"


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class State:
    """Horovod's elastic state: what a restart brings back.

    Subclasses define :meth:`save`, :meth:`restore`, :meth:`sync` and the payload that a
    commit persists. Every rank must call :meth:`commit` at the same points of training.

    Args:
        bcast_object: ``broadcast_object(obj, root_rank, name=None)`` of the framework.
        get_rank: returns this rank.
        allgather_object: ``allgather_object(obj, name=None)`` of the framework.
    """

    def __init__(
        self,
        bcast_object: Callable[..., Any],
        get_rank: Callable[[], int],
        allgather_object: Callable[..., list[Any]] | None = None,
    ) -> None:
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        self._allgather_object = allgather_object
        self._reset_callbacks: list[Callable[[], None]] = []
        self._host_messages: queue.Queue[tuple[float, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._commits = 0
        self._resumed = False
        config = runtime.config
        self._hosts_version = config.elastic_hosts_version if config is not None else 0
        folder = config.elastic_dir if config is not None else None
        self._store = CheckpointStore(folder) if folder else None

    # -- Horovod's API ---------------------------------------------------------------------

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Adds functions to call after every reset (e.g. to rescale the learning rate to
        the new ``size()``); in baguahvd also after a restart resumes from a commit."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs :meth:`reset` and then the reset callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None:
        """Records a host change; the next :meth:`check_host_updates` acts on it."""
        self._host_messages.put((timestamp, HostUpdateResult(update_res)))

    def commit(self) -> None:
        """Saves the state in memory and in the elastic folder, then checks for host
        changes (raising :class:`HostsUpdatedInterrupt` on every rank if there was one)."""
        self.save()
        self._commits += 1
        self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises :class:`HostsUpdatedInterrupt` on every rank when rank 0 has seen the host
        set change since the last check. Collective: every rank must call it."""
        # Rank 0 decides, so that every rank raises at the same commit.
        result = HostUpdateResult.no_update
        timestamp = self._last_updated_timestamp
        while not self._host_messages.empty():
            when, update = self._host_messages.get()
            result |= update
            timestamp = max(timestamp, when)
        if self._store is not None and self._get_rank() == 0:
            version, update = self._store.hosts_notice()
            if version > self._hosts_version:
                self._hosts_version = version
                result |= update
        decided, self._last_updated_timestamp, self._hosts_version = self._bcast_object(
            (int(result), timestamp, self._hosts_version), 0, name="elastic.host_updates"
        )
        if decided != HostUpdateResult.no_update:
            raise HostsUpdatedInterrupt(decided == HostUpdateResult.removed)

    def save(self) -> None:
        """Keeps a copy of the current state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Puts the last saved copy back."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every rank's state equal to rank 0's and saves it. Collective."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called before the reset callbacks; subclasses refresh size-dependent parts."""

    # -- persistence -----------------------------------------------------------------------

    def _payload(self) -> Any:
        """The saved state, as written to a commit file."""
        raise NotImplementedError

    def _load_payload(self, payload: Any) -> None:
        """Makes ``payload`` (from :meth:`_payload`) the saved and the current state."""
        raise NotImplementedError

    def _persist(self) -> None:
        if self._store is None or runtime.local_rank() != 0:
            return
        self._store.write(self._commits, self._payload())

    def _resume(self) -> bool:
        """Loads the newest persisted commit that any rank sees into rank 0's state, ready
        for :meth:`sync`; returns False when there is none. Collective. Only the first call
        for a state reads the folder: later runs of the same state continue from memory."""
        if self._store is None or self._resumed:
            return False
        self._resumed = True
        if self._allgather_object is None:
            raise RuntimeError("resuming from a commit needs allgather_object")
        seen = self._allgather_object(self._store.newest(), name="elastic.resume")
        newest = max(seen)
        if newest < 0:
            return False
        holder = seen.index(newest)
        rank = self._get_rank()
        payload = self._store.read(newest) if rank == holder else None
        if holder != 0:  # only with per-host folders that rank 0's host lacks
            payload = self._bcast_object(payload, holder, name="elastic.resume.payload")
        if rank == 0:
            self._load_payload(payload)
        self._commits = newest
        logger.info("resuming from commit %d (found by rank %d)", newest, holder)
        return True


class ObjectState(State):
    """A state of plain Python values, given as keyword arguments and read and written as
    attributes (``state.epoch += 1``). Values are deep-copied when saved, so restoring
    also undoes changes made inside mutable values.

    Args:
        bcast_object: ``broadcast_object(obj, root_rank, name=None)`` of the framework.
        get_rank: returns this rank.
        allgather_object: ``allgather_object(obj, name=None)`` of the framework.
        **kwargs: the values.
    """

    def __init__(
        self,
        bcast_object: Callable[..., Any],
        get_rank: Callable[[], int],
        allgather_object: Callable[..., list[Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank, allgather_object)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self.save()
            self._saved_state = self._bcast_object(self._saved_state, 0, name="elastic.objects")
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            object.__setattr__(self, name, copy.deepcopy(value))

    def _payload(self) -> Any:
        return {"objects": self._saved_state}

    def _load_payload(self, payload: Any) -> None:
        objects = payload["objects"]
        if objects.keys() != self._saved_state.keys():
            logger.warning(
                "the commit holds the values %s but this state has %s; loading the shared ones",
                sorted(objects),
                sorted(self._saved_state),
            )
        self._saved_state.update(
            (name, value) for name, value in objects.items() if name in self._saved_state
        )
        self._set_attrs()


def run_fn(func: Callable[..., _Result], reset: Callable[[], None]) -> Callable[..., _Result]:
    """Wraps ``func(state, *args, **kwargs)`` in Horovod's elastic retry loop.

    The wrapper resumes from the newest persisted commit (when there is one), syncs the
    state from rank 0, and calls ``func``. A host change reported at a
    commit ends the job with ``RESIZE_EXIT_CODE`` under ``baguahvdrun --elastic`` (which
    relaunches it on the new hosts); outside it, ``reset()`` re-initialises in place and
    training resumes after the reset callbacks. A failed collective
    (``HorovodInternalError``) ends this rank: the job cannot continue on a broken MPI
    world, and ``baguahvdrun --elastic`` restarts it from the last commit.

    Args:
        func: the training function; its first argument is the state.
        reset: re-initialises the framework (``shutdown(); init()``).

    Returns:
        The wrapper, with the signature of ``func``.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> _Result:
        config = runtime.config
        relaunched = config is not None and config.elastic_restart > 0
        if state._resume() or relaunched:
            state.on_reset()
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                if state._store is None:
                    logger.error(
                        "a collective failed; run under `baguahvdrun --elastic` to restart "
                        "from the last commit"
                    )
                raise
            except HostsUpdatedInterrupt as interrupt:
                if state._store is not None:
                    logger.info("the hosts changed; ending this launch to resize the job")
                    raise SystemExit(protocol.RESIZE_EXIT_CODE) from None
                skip_sync = interrupt.skip_sync
            reset()
            state.on_reset()

    return wrapper
