"""The low-level file operations of the elastic folder: synced whole writes, a sink that
hashes what ``torch.save`` writes, folder syncs."""

from __future__ import annotations

import hashlib
import os

__all__ = ["HashingSink", "fsync_folder", "read_bytes", "remove", "write_all", "write_view"]


def write_all(descriptor: int, data: bytes | memoryview) -> None:
    """Writes ``data`` to the descriptor, fsyncs and closes it."""
    try:
        write_view(descriptor, data)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_view(descriptor: int, data: bytes | memoryview) -> None:
    """Writes all of ``data`` to the descriptor."""
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]


class HashingSink:
    """A file object for ``torch.save`` that writes to a descriptor and hashes what it
    writes."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        write_view(self._descriptor, view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        """Nothing is buffered."""


def read_bytes(path: str) -> bytes:
    """The content of the file at ``path``."""
    with open(path, "rb") as stream:
        return stream.read()


def fsync_folder(folder: str) -> None:
    """Syncs the folder's entries (renames and new files), where the filesystem can."""
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


def remove(path: str) -> None:
    """Removes the file at ``path`` if it is there."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
