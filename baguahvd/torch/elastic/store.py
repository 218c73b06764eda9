"""The commit folder of an elastic job: verified commit files, the job id, the finished mark.

Layout and formats are the contract of :mod:`baguahvd.common.elastic_protocol`: commit
``n`` of a host is a payload ``commit-<n>.<host>.pt`` (tensors and plain values in the
container of :mod:`.files`, or ``torch.save``'s for tensors the container does not hold;
either is read by a loader that builds nothing else, so loading cannot run code) and its
manifest ``commit-<n>.<host>.json`` (format, job id, host, number, payload size and
SHA-256), written after the payload is synced. :class:`CheckpointStore` writes and lists
them, verifies each when it is loaded, falls back from a damaged commit to the one before,
and ignores (with a warning naming them) files this job did not write.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import io
import json
import logging
import os
import re
import socket
import tempfile
import time
import uuid
from typing import IO, Any, cast

import torch

from baguahvd.common import elastic_protocol as protocol
from baguahvd.torch.elastic.files import (
    HashingSink,
    fsync_folder,
    is_container,
    pack,
    read_bytes,
    remove,
    unpack,
    write_all,
)

logger = logging.getLogger(__name__)


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

    Commit ``n`` of a host is ``commit-<n>.<host>.pt``, tensors and plain values in the
    container of :mod:`.files` (their pickle, then the tensors' bytes raw), or a
    ``torch.save`` where a tensor is not a dense CPU one; either is read back by a loader
    that builds tensors and plain values only (``weights_only=True`` for ``torch.save``,
    which also reads the commits of earlier versions), so loading cannot run code; and
    ``commit-<n>.<host>.json``, its manifest: format, job id, host, number, payload
    size and SHA-256. Both are written under temporary names, fsynced, and renamed payload
    first, so the manifest makes a commit count only once its payload is durable. Loading
    checks the payload against its manifest (not reading it back after the write, which
    would read the page cache the write just filled, not the disk). A host keeps its two
    newest commits, so a commit damaged later still leaves one to fall back on. The job id
    comes from :data:`~baguahvd.common.elastic_protocol.JOB_FILE`, created by the first
    store that finds none; files of other jobs, unknown names and payloads without a
    manifest are ignored with a warning naming them.

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
            write_all(descriptor, _job_record(job_id))
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
            remove(manifest)
            remove(payload)
        remove(self._path(protocol.FINISHED_FILE))
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
        """
        check_plain(payload, "commit")
        base = f"commit-{number}.{self.host}"
        payload_path, manifest_path = self._path(f"{base}.pt"), self._path(f"{base}.json")
        payload_temporary, size, digest = self._temporary_payload(payload)
        manifest = {
            "format": protocol.COMMIT_FORMAT,
            "job_id": self.job_id,
            "host": self.host,
            "commit": number,
            "payload": f"{base}.pt",
            "bytes": size,
            "sha256": digest,
        }
        try:
            manifest_temporary = self._temporary(json.dumps(manifest).encode())
        except BaseException:
            remove(payload_temporary)
            raise
        placed = False
        try:
            remove(manifest_path)  # an older manifest must not vouch for the new payload
            os.replace(payload_temporary, payload_path)
            placed = True
            os.replace(manifest_temporary, manifest_path)
            fsync_folder(self.folder)
        except BaseException:
            remove(payload_temporary)
            remove(manifest_temporary)
            if placed and not os.path.exists(manifest_path):
                remove(payload_path)
            raise
        # Keep the previous commit too, in case this one is damaged later; numbers above
        # this one belong to a timeline abandoned when resuming fell back past them.
        mine = [entry for entry in self._listing(self.job_id) if entry[1] == self.host]
        previous = max((entry[0] for entry in mine if entry[0] < number), default=None)
        for older, _, older_manifest, older_payload in mine:
            if older not in (number, previous):
                remove(older_manifest)
                remove(older_payload)
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
                remove(self._path(name))

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
                if name not in _FOLDER_FILES and not name.startswith(_PASSING_PREFIXES):
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
            data = read_bytes(payload_path)
        except OSError as error:
            raise CommitError(f"commit {payload_path} cannot be read: {error}") from None
        except ValueError as error:
            if isinstance(error, CommitError):
                raise
            raise CommitError(f"commit manifest {manifest_path} is unreadable: {error}") from None
        _verify(payload_path, data, manifest.get("bytes"), manifest.get("sha256"))
        try:
            if is_container(data):
                return unpack(data)
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - anything the unpickler refuses
            raise CommitError(
                f"commit {payload_path} holds more than tensors and plain values and was not "
                f"loaded: {str(error).splitlines()[0]}"
            ) from None

    def _temporary(self, data: bytes | memoryview) -> str:
        descriptor, temporary = tempfile.mkstemp(prefix=self._temporary_prefix, dir=self.folder)
        try:
            write_all(descriptor, data)
        except BaseException:
            remove(temporary)
            raise
        return temporary

    def _temporary_payload(self, payload: Any) -> tuple[str, int, str]:
        """``payload`` in a synced temporary file, hashed as it is written (one pass over
        the bytes, no copy of them in memory): (path, size, SHA-256). In the container
        where it holds every tensor, which computes nothing but the SHA-256 over the
        tensors' bytes; else ``torch.save``, which also takes a CRC-32 of them."""
        packed = pack(payload)
        descriptor, temporary = tempfile.mkstemp(prefix=self._temporary_prefix, dir=self.folder)
        sink = HashingSink(descriptor)
        try:
            try:
                if packed is not None:
                    packed.write_to(sink)
                else:
                    torch.save(payload, cast(IO[bytes], sink))  # it needs write() only
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        except BaseException:
            remove(temporary)
            raise
        return temporary, sink.size, sink.sha256.hexdigest()

    def _replace(self, name: str, data: bytes) -> None:
        temporary = self._temporary(data)
        try:
            os.replace(temporary, self._path(name))
        except BaseException:
            remove(temporary)
            raise
        fsync_folder(self.folder)


_FOLDER_FILES = frozenset(
    {
        protocol.JOB_FILE,
        protocol.FINISHED_FILE,
        protocol.HOSTS_NOTICE_FILE,
        protocol.TRAINING_MARK_FILE,
        protocol.ROUND_FILE,
    }
)
# Files that come and go beside the commits: temporary commit files, in-process recovery's
# round requests and the round file being replaced.
_PASSING_PREFIXES = (_TEMPORARY_PREFIX, protocol.ROUND_REQUEST_PREFIX, f"{protocol.ROUND_FILE}.")


def _job_record(job_id: str) -> bytes:
    return json.dumps({"job_id": job_id, "format": protocol.COMMIT_FORMAT}).encode()


def _verify(path: str, data: bytes, size: Any, digest: Any) -> None:
    if len(data) != size:
        raise CommitError(f"commit {path} is damaged: {len(data)} bytes, its manifest says {size}")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CommitError(f"commit {path} is damaged: its SHA-256 differs from its manifest's")


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text) or "host"


def check_plain(value: Any, where: str) -> None:
    """Raises TypeError naming the first value that ``weights_only`` loading would refuse."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN_SCALARS:
        return
    if type(value) in _PLAIN_CONTAINERS:
        if isinstance(value, dict):
            for key, item in value.items():
                check_plain(key, f"{where} key {key!r}")
                check_plain(item, f"{where}[{key!r}]")
        else:
            for index, item in enumerate(value):
                check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: a commit holds only "
        "tensors and plain values (None, bool, int, float, complex, str, bytes, torch dtypes, "
        "devices and sizes, in lists, tuples, sets and dicts). Convert it, or give its state "
        "a StateHandler whose saved() returns such values."
    )
