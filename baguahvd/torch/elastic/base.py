"""Elastic training: states that survive a restart, and the retry loop around training.

Horovod re-forms its Gloo ring inside the running processes. baguahvd runs on MPI, whose
world cannot shrink or grow in place, so it recovers by restarting the job instead:

1. ``state.commit()`` keeps a copy of the state in memory on every rank (``save()``) and,
   when ``BAGUAHVD_ELASTIC_DIR`` is set (``baguahvdrun --elastic`` sets it), persists that
   copy to the folder: the first rank of every host writes commit ``n`` as
   ``commit-<n>.<host>.pt`` (tensors and plain values, loaded with ``weights_only=True``)
   and its manifest ``commit-<n>.<host>.json`` (job id, host, number, SHA-256), and keeps
   its previous commit until the new one is synced and read back intact.
2. When a rank dies or raises, the job ends (see the reliability section of the README)
   and ``baguahvdrun --elastic`` launches it again, possibly on other hosts.
3. In the new job, :func:`run_fn`'s wrapper finds the newest commit that verifies on any
   host (a damaged one is refused with its file named, and the one before is used),
   loads it into rank 0's state (sent over by a rank that sees it when rank 0's host has
   no copy), runs the reset callbacks, and syncs every rank from rank 0 before calling the
   training function again. Training resumes exactly at the
   last commit: no step is lost and none is applied twice.

When the launcher's host discovery reports a change, it writes a notice into the folder;
the next ``commit()`` sees it on rank 0, every rank raises :class:`HostsUpdatedInterrupt`
and the wrapper ends the job with :data:`~baguahvd.common.elastic_protocol.RESIZE_EXIT_CODE`
so that the launcher relaunches it on the new hosts at once.

When the training function returns, the folder records that the job finished. A later
run on the folder (launch ``0``) does not resume it: by default it says so and starts
afresh (``BAGUAHVD_ELASTIC_FINISHED`` chooses ``resume`` or ``refuse`` instead).
"""

from __future__ import annotations

import collections
import copy
import enum
import functools
import hashlib
import io
import json
import logging
import os
import queue
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from baguahvd.common import elastic_protocol as protocol
from baguahvd.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from baguahvd.runtime.state import runtime

logger = logging.getLogger(__name__)

_Result = TypeVar("_Result")



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


class CommitError(ValueError):
    """A file of the elastic folder that does not verify; the message names it."""


class FinishedJobError(RuntimeError):
    """Raised when a new run finds that the elastic folder's job already finished and
    ``BAGUAHVD_ELASTIC_FINISHED=refuse``."""


_COMMIT_FILE = re.compile(r"^commit-(\d+)\.(.+)\.(pt|json)$")
_TEMPORARY_PREFIX = ".commit-"
_JOB_ID = re.compile(r"^[0-9a-f]{32}$")
_JOB_FILE_WAIT_S = 5.0
_PLAIN_SCALARS = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size
)
_PLAIN_CONTAINERS = (list, tuple, set, dict, collections.OrderedDict)


class CheckpointStore:
    """The commits of one host in the elastic folder, and the folder's job records.

    Commit ``n`` of a host is ``commit-<n>.<host>.pt``, a ``torch.save`` of tensors and
    plain values that is read back with ``weights_only=True`` (so loading cannot run code),
    and ``commit-<n>.<host>.json``, its manifest: format, job id, host, number, payload
    size and SHA-256. Both are written under temporary names, fsynced, and renamed payload
    first; the payload is read back and checked before the manifest makes it count. A
    host keeps its two newest commits, so a commit damaged later still leaves one to fall
    back on. The job id comes from :data:`~baguahvd.common.elastic_protocol.JOB_FILE`,
    created by the first store that finds none; files of other jobs, unknown names and
    payloads without a manifest are ignored with a warning naming them.

    Args:
        folder: the elastic folder (created when missing).
        host: this host's name, as it appears in the file names.
    """

    def __init__(self, folder: str, host: str | None = None) -> None:
        self.folder = folder
        self.host = _safe_name(host or socket.gethostname())
        os.makedirs(folder, exist_ok=True)
        self._job_id: str | None = None
        self._warned: set[str] = set()
        self._marked = False
        self._temporary_prefix = f"{_TEMPORARY_PREFIX}{self.host}."

    # -- the job ---------------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        """The id of the job that owns the folder (created on first use)."""
        if self._job_id is None:
            self._job_id = self._read_or_create_job()
        return self._job_id

    def reload_job(self) -> None:
        """Forgets the cached job id (another rank may have started a new job)."""
        self._job_id = None

    def _read_or_create_job(self) -> str:
        path = self._path(protocol.JOB_FILE)
        job_id = uuid.uuid4().hex
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            _write_all(descriptor, _job_record(job_id))
            return job_id
        # Another rank created it and may still be writing it: wait for a whole record.
        deadline = time.monotonic() + _JOB_FILE_WAIT_S
        while True:
            try:
                with open(path, encoding="utf-8") as stream:
                    job = json.load(stream)
                if job.get("format") != protocol.COMMIT_FORMAT or not _JOB_ID.match(
                    str(job.get("job_id"))
                ):
                    raise ValueError(f"unexpected content {job!r}")
                return str(job["job_id"])
            except (OSError, ValueError, AttributeError) as error:
                if time.monotonic() > deadline:
                    raise CommitError(
                        f"{path} does not name a baguahvd job ({error}); remove it (and the "
                        "folder's commits, which cannot be trusted without it) to start a "
                        "new job"
                    ) from None
                time.sleep(0.05)

    def start_fresh(self) -> None:
        """Gives the folder a new job id and removes the old job's commits and records."""
        old = self.job_id
        for _, _, manifest, payload in self._listing(old):
            _remove(manifest)
            _remove(payload)
        _remove(self._path(protocol.FINISHED_FILE))
        job_id = uuid.uuid4().hex
        self._replace(protocol.JOB_FILE, _job_record(job_id))
        self._job_id = job_id

    def finished(self) -> int | None:
        """The commit at which this job's training function returned, None if it has not."""
        path = self._path(protocol.FINISHED_FILE)
        try:
            with open(path, encoding="utf-8") as stream:
                record = json.load(stream)
            job, number = record["job_id"], int(record["commit"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            self._warn(path, f"ignoring unreadable {path}: {error}")
            return None
        if job != self.job_id:
            self._warn(path, f"ignoring {path}: it belongs to job {job}, not {self.job_id}")
            return None
        return number

    def mark_finished(self, number: int) -> None:
        """Records that training returned after commit ``number``."""
        record = {"job_id": self.job_id, "commit": number}
        self._replace(protocol.FINISHED_FILE, json.dumps(record).encode())

    def mark_training(self) -> None:
        """Creates the launcher's training mark, once per store."""
        if self._marked:
            return
        self._marked = True
        path = self._path(protocol.TRAINING_MARK_FILE)
        try:
            if not os.path.exists(path):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError as error:
            logger.warning("could not create the training mark %s: %s", path, error)

    # -- commits ---------------------------------------------------------------------------

    def commits(self) -> dict[int, str]:
        """This job's commits with a manifest (of any host, unverified): number → manifest
        path. Warns once about every file that does not belong there."""
        found: dict[int, str] = {}
        for number, _, manifest, _ in self._listing(self.job_id):
            found.setdefault(number, manifest)
        return found

    def newest(self) -> int:
        """The number of the newest commit listed (unverified), -1 when there is none."""
        return max(self.commits(), default=-1)

    def load_newest(self) -> tuple[int, Any]:
        """The newest commit that verifies, as (number, payload); (-1, None) when none
        does. Every commit refused on the way is logged with its file and reason."""
        refused: list[str] = []
        for number, host, manifest, payload in sorted(self._listing(self.job_id), reverse=True):
            try:
                loaded = self._load(number, host, manifest, payload)
            except CommitError as error:
                logger.warning("%s; falling back to an older commit", error)
                refused.append(os.path.basename(payload))
                continue
            if refused:
                logger.warning(
                    "resuming from commit %d (%s); refused: %s",
                    number,
                    os.path.basename(payload),
                    ", ".join(refused),
                )
            return number, loaded
        if refused:
            logger.error("no intact commit in %s; refused: %s", self.folder, ", ".join(refused))
        return -1, None

    def read(self, number: int) -> Any:
        """Loads commit ``number`` (tensors on the CPU), trying every host's copy.

        Raises:
            FileNotFoundError: no manifest of this job has that number.
            CommitError: no copy verifies; the message names the file and why.
        """
        copies = [entry for entry in self._listing(self.job_id) if entry[0] == number]
        if not copies:
            for name in sorted(os.listdir(self.folder)):
                match = _COMMIT_FILE.match(name)
                if match and int(match.group(1)) == number and match.group(3) == "json":
                    raise CommitError(
                        f"commit manifest {self._path(name)} is unreadable or not this job's"
                    )
            raise FileNotFoundError(f"commit {number} is not in {self.folder}")
        errors = []
        for _, host, manifest, payload in copies:
            try:
                return self._load(number, host, manifest, payload)
            except CommitError as error:
                errors.append(error)
        raise errors[0]

    def write(self, number: int, payload: Any) -> str:
        """Persists commit ``number`` of this host; then keeps only it and the previous one.

        Raises:
            TypeError: the payload holds something other than tensors and plain values.
            OSError: the folder could not take the files (e.g. ``ENOSPC``); the earlier
                commits are left as they were.
            CommitError: the payload read back from the disk differs from what was written.
        """
        _check_plain(payload, "commit")
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = buffer.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        base = f"commit-{number}.{self.host}"
        payload_path, manifest_path = self._path(f"{base}.pt"), self._path(f"{base}.json")
        manifest = {
            "format": protocol.COMMIT_FORMAT,
            "job_id": self.job_id,
            "host": self.host,
            "commit": number,
            "payload": f"{base}.pt",
            "bytes": len(data),
            "sha256": digest,
        }
        payload_temporary = self._temporary(data)
        try:
            manifest_temporary = self._temporary(json.dumps(manifest).encode())
        except BaseException:
            _remove(payload_temporary)
            raise
        placed = False
        try:
            _remove(manifest_path)  # an older manifest must not vouch for the new payload
            os.replace(payload_temporary, payload_path)
            placed = True
            _verify(payload_path, _read_bytes(payload_path), len(data), digest)
            os.replace(manifest_temporary, manifest_path)
            _fsync_folder(self.folder)
        except BaseException:
            _remove(payload_temporary)
            _remove(manifest_temporary)
            if placed and not os.path.exists(manifest_path):
                _remove(payload_path)
            raise
        # Keep the previous commit too, in case this one is damaged later; numbers above
        # this one belong to a timeline abandoned when resuming fell back past them.
        mine = [entry for entry in self._listing(self.job_id) if entry[1] == self.host]
        previous = max((entry[0] for entry in mine if entry[0] < number), default=None)
        for older, _, older_manifest, older_payload in mine:
            if older not in (number, previous):
                _remove(older_manifest)
                _remove(older_payload)
        self._remove_leftovers({os.path.basename(entry[3]) for entry in mine})
        return payload_path

    def _remove_leftovers(self, vouched: set[str]) -> None:
        """Removes what this host's killed writers left: temporary files and payloads
        whose manifest was never written (other jobs' files, with a manifest, stay)."""
        suffix = f".{self.host}.pt"
        names = set(os.listdir(self.folder))
        for name in names:
            orphan = (
                name.endswith(suffix)
                and name not in vouched
                and f"{name[:-3]}.json" not in names
                and _COMMIT_FILE.match(name) is not None
            )
            if orphan or name.startswith(self._temporary_prefix):
                _remove(self._path(name))

    def hosts_notice(self) -> tuple[int, HostUpdateResult]:
        """The newest host-change notice of the launcher: (version, what changed)."""
        path = self._path(protocol.HOSTS_NOTICE_FILE)
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

    # -- helpers ---------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s", message)

    def _listing(self, job_id: str) -> list[tuple[int, str, str, str]]:
        """(number, host, manifest path, payload path) of every manifest of ``job_id``."""
        try:
            names = sorted(os.listdir(self.folder))
        except FileNotFoundError:
            return []
        listed = []
        payloads: set[str] = set()
        for name in names:
            match = _COMMIT_FILE.match(name)
            if match is None:
                if name not in _FOLDER_FILES and not name.startswith(_TEMPORARY_PREFIX):
                    self._warn(name, f"ignoring {self._path(name)}: not a file of this job")
                continue
            if match.group(3) == "pt":
                payloads.add(name)
                continue
            path = self._path(name)
            try:
                with open(path, encoding="utf-8") as stream:
                    manifest = json.load(stream)
                owner = manifest["job_id"]
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as error:
                self._warn(name, f"ignoring {path}: not a commit manifest ({error})")
                continue
            if owner != job_id:
                self._warn(name, f"ignoring {path}: written by job {owner}, not {job_id}")
                continue
            payload = f"commit-{match.group(1)}.{match.group(2)}.pt"
            listed.append((int(match.group(1)), match.group(2), path, self._path(payload)))
        payloads -= {os.path.basename(entry[3]) for entry in listed}
        for name in sorted(payloads):
            self._warn(name, f"ignoring {self._path(name)}: no manifest of this job vouches for it")
        return listed

    def _load(self, number: int, host: str, manifest_path: str, payload_path: str) -> Any:
        try:
            with open(manifest_path, encoding="utf-8") as stream:
                manifest = json.load(stream)
            expected = {
                "format": protocol.COMMIT_FORMAT,
                "job_id": self.job_id,
                "commit": number,
                "host": host,
                "payload": os.path.basename(payload_path),
            }
            wrong = {k: manifest.get(k) for k, v in expected.items() if manifest.get(k) != v}
            if wrong:
                raise CommitError(
                    f"commit manifest {manifest_path} does not match its name and job: {wrong}"
                )
            data = _read_bytes(payload_path)
        except OSError as error:
            raise CommitError(f"commit {payload_path} cannot be read: {error}") from None
        except ValueError as error:
            if isinstance(error, CommitError):
                raise
            raise CommitError(f"commit manifest {manifest_path} is unreadable: {error}") from None
        _verify(payload_path, data, manifest.get("bytes"), manifest.get("sha256"))
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - anything the unpickler refuses
            raise CommitError(
                f"commit {payload_path} holds more than tensors and plain values and was not "
                f"loaded: {str(error).splitlines()[0]}"
            ) from None

    def _temporary(self, data: bytes) -> str:
        descriptor, temporary = tempfile.mkstemp(prefix=self._temporary_prefix, dir=self.folder)
        try:
            _write_all(descriptor, data)
        except BaseException:
            _remove(temporary)
            raise
        return temporary

    def _replace(self, name: str, data: bytes) -> None:
        temporary = self._temporary(data)
        try:
            os.replace(temporary, self._path(name))
        except BaseException:
            _remove(temporary)
            raise
        _fsync_folder(self.folder)


_FOLDER_FILES = frozenset(
    {
        protocol.JOB_FILE,
        protocol.FINISHED_FILE,
        protocol.HOSTS_NOTICE_FILE,
        protocol.TRAINING_MARK_FILE,
    }
)


def _job_record(job_id: str) -> bytes:
    return json.dumps({"job_id": job_id, "format": protocol.COMMIT_FORMAT}).encode()


def _write_all(descriptor: int, data: bytes) -> None:
    """Writes ``data`` to the descriptor, fsyncs and closes it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view) :]
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as stream:
        return stream.read()


def _verify(path: str, data: bytes, size: Any, digest: Any) -> None:
    if len(data) != size:
        raise CommitError(f"commit {path} is damaged: {len(data)} bytes, its manifest says {size}")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CommitError(f"commit {path} is damaged: its SHA-256 differs from its manifest's")


def _fsync_folder(folder: str) -> None:
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some filesystems cannot sync a folder; the files themselves are synced
    finally:
        os.close(descriptor)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text) or "host"


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _check_plain(value: Any, where: str) -> None:
    """Raises TypeError naming the first value that ``weights_only`` loading would refuse."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN_SCALARS:
        return
    if type(value) in _PLAIN_CONTAINERS:
        if isinstance(value, dict):
            for key, item in value.items():
                _check_plain(key, f"{where} key {key!r}")
                _check_plain(item, f"{where}[{key!r}]")
        else:
            for index, item in enumerate(value):
                _check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: a commit holds only "
        "tensors and plain values (None, bool, int, float, complex, str, bytes, torch dtypes, "
        "devices and sizes, in lists, tuples, sets and dicts). Convert it, or give its state "
        "a StateHandler whose saved() returns such values."
    )


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
        self._average_replicas()
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

    def _average_replicas(self) -> None:
        """Replaces the saved copy by its average over the ranks where ranks keep their own
        replicas (weight-averaging algorithms), so that a commit is the same on every
        rank. Collective, called by :meth:`commit` after :meth:`save`."""

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
        """Loads the newest intact persisted commit that any host sees into rank 0's state,
        ready for :meth:`sync`; returns False when there is none. Collective. Only the first
        call for a state reads the folder: later runs of the same state continue from
        memory. A finished job is not resumed by a new run (see ``elastic_finished``)."""
        if self._store is None or self._resumed:
            return False
        self._resumed = True
        if self._allgather_object is None:
            raise RuntimeError("resuming from a commit needs allgather_object")
        if self._finished_job_handled():
            return False
        # One reader per host: the ranks of a host see the same folder.
        leader = runtime.local_rank() == 0
        newest, payload = self._store.load_newest() if leader else (-1, None)
        seen = self._allgather_object(newest, name="elastic.resume")
        newest = max(seen)
        if newest < 0:
            return False
        holder = seen.index(newest)
        rank = self._get_rank()
        if holder != 0:  # only with per-host folders that rank 0's host lacks
            payload = self._bcast_object(
                payload if rank == holder else None, holder, name="elastic.resume.payload"
            )
        if rank == 0:
            self._load_payload(payload)
        self._commits = newest
        logger.info("resuming from commit %d (found by rank %d)", newest, holder)
        return True

    def _finished_job_handled(self) -> bool:
        """Applies the finished-job rule; True when the job starts afresh. Collective."""
        assert self._store is not None and self._allgather_object is not None
        config = runtime.config
        leader = runtime.local_rank() == 0
        finished = self._store.finished() if leader else None
        seen = self._allgather_object(finished, name="elastic.finished")
        done = [commit for commit in seen if commit is not None]
        if not done:
            return False
        policy = config.elastic_finished if config is not None else "fresh"
        relaunched = config is not None and config.elastic_restart > 0
        folder = self._store.folder
        if policy == "refuse":
            raise FinishedJobError(
                f"the job in {folder} finished training (at commit {max(done)}); use another "
                "folder, remove this one, or set BAGUAHVD_ELASTIC_FINISHED=fresh (train "
                "again) or =resume (continue from its last commit)"
            )
        if policy == "resume" or relaunched:
            if self._get_rank() == 0:
                logger.warning(
                    "the job in %s finished training at commit %d; resuming from its last "
                    "commit", folder, max(done)
                )
            return False
        if self._get_rank() == 0:
            logger.warning(
                "the job in %s finished training at commit %d; starting afresh and removing "
                "its commits (BAGUAHVD_ELASTIC_FINISHED=resume continues from them instead)",
                folder,
                max(done),
            )
            if finished is not None:
                self._store.start_fresh()
        # Rank 0 first, so that a shared folder gets one new job id; then every other
        # host whose own folder still records the finished job.
        self._bcast_object(None, 0, name="elastic.fresh")
        if leader and self._get_rank() != 0:
            self._store.reload_job()
            if self._store.finished() is not None:
                self._store.start_fresh()
        self._allgather_object(None, name="elastic.fresh.done")
        self._store.reload_job()
        return True

    def _finish(self) -> None:
        """Records in the folder that the training function returned."""
        if self._store is not None and runtime.local_rank() == 0:
            self._store.mark_finished(self._commits)


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
            if state._store is not None:
                state._store.mark_training()
            try:
                result = func(state, *args, **kwargs)
                state._finish()
                return result
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
