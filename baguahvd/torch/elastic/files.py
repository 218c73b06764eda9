"""The low-level file operations of the elastic folder: synced whole writes, a sink that
hashes what it writes, folder syncs, and the container that commits are written in."""

from __future__ import annotations

import collections
import ctypes
import hashlib
import io
import os
import pickle
from typing import Any

import torch

__all__ = [
    "CONTAINER_MAGIC",
    "HashingSink",
    "Packed",
    "fsync_folder",
    "is_container",
    "pack",
    "read_bytes",
    "remove",
    "unpack",
    "write_all",
    "write_view",
]


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
    """A file object (for the container, or ``torch.save``) that writes to a descriptor and
    hashes what it writes."""

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


# -- the commit container -----------------------------------------------------------------
#
# A commit's payload as: CONTAINER_MAGIC, the length of a pickle (8 bytes, little-endian),
# the pickle (protocol 4) of the payload with every tensor replaced by a persistent id that
# describes it (storage number and size, dtype, shape, strides, offset, requires_grad,
# parameter or not; a tensor met again, by the index of its first appearance), then the
# bytes of every storage, raw, in the order of their numbers.
# Written through a HashingSink, every byte is covered by the SHA-256 of the manifest, and
# nothing else is computed over them: torch.save's zip records also take a CRC-32 of every
# byte (with the GIL held), which the SHA-256 makes redundant here. Loading builds only
# tensors and plain values: the unpickler knows no other class.

CONTAINER_MAGIC = b"baguahvd commit container 1\n"
_LENGTH_BYTES = 8
_PROTOCOL = 4
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", "complex"): complex,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "device"): torch.device,
    ("torch", "Size"): torch.Size,
}


class Packed:
    """A payload made ready for the container: its pickle and the storages whose bytes
    follow it. Build it with :func:`pack`."""

    def __init__(self, head: bytes, storages: list[torch.UntypedStorage]) -> None:
        self.head = head
        self.storages = storages

    def write_to(self, sink: HashingSink) -> None:
        """Writes the container to ``sink``; the storages' bytes are not copied."""
        sink.write(CONTAINER_MAGIC + len(self.head).to_bytes(_LENGTH_BYTES, "little"))
        sink.write(self.head)
        for storage in self.storages:
            if storage.nbytes():
                sink.write(_bytes_of(storage))


class _Unpackable(Exception):
    """A tensor that the container does not hold as raw bytes."""


def pack(payload: Any) -> Packed | None:
    """``payload`` ready for the container; None when one of its tensors is not a dense
    CPU tensor (or parameter) without lazy conjugation or negation, for ``torch.save``."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    try:
        pickler.dump(payload)
    except _Unpackable:
        return None
    return Packed(buffer.getvalue(), pickler.storages)


class _Pickler(pickle.Pickler):
    """Pickles tensors as persistent ids, numbering their storages (a storage shared by
    several tensors is written once)."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=_PROTOCOL)
        self.storages: list[torch.UntypedStorage] = []
        self._numbers: dict[tuple[int, int], int] = {}
        # A tensor met again (tied weights) is named by its first appearance, so that it
        # loads as the same object; the payload keeps every tensor alive meanwhile.
        self._tensors: dict[int, int] = {}

    def persistent_id(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return None
        if not _packable(value):
            raise _Unpackable
        seen = self._tensors.get(id(value))
        if seen is not None:
            return ("again", seen)
        self._tensors[id(value)] = len(self._tensors)
        storage = value.untyped_storage()
        number = self._numbers.setdefault(
            (storage.data_ptr(), storage.nbytes()), len(self.storages)
        )
        if number == len(self.storages):
            self.storages.append(storage)
        return (
            "tensor", number, storage.nbytes(), str(value.dtype).removeprefix("torch."),
            tuple(value.shape), tuple(value.stride()), value.storage_offset(),
            value.requires_grad, isinstance(value, torch.nn.Parameter),
        )


def _packable(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) in _TENSOR_TYPES
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _bytes_of(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage, as a view of its memory (valid while it lives)."""
    array = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    return memoryview(array).cast("B")


def is_container(data: bytes | memoryview) -> bool:
    """Whether ``data`` starts as the container does (other payloads are ``torch.save``'s)."""
    return bytes(data[: len(CONTAINER_MAGIC)]) == CONTAINER_MAGIC


def unpack(data: bytes | memoryview) -> Any:
    """The payload of a container, its tensors on the CPU, each storage a copy of its own.

    Raises:
        pickle.UnpicklingError: ``data`` is not a whole container of tensors and plain
            values (a class other than those of plain values, a tensor that does not fit
            its storage, storages that do not end where the data does).
    """
    view = memoryview(data).cast("B")
    start = len(CONTAINER_MAGIC) + _LENGTH_BYTES
    if not is_container(view) or len(view) < start:
        raise pickle.UnpicklingError("not a commit container")
    end = start + int.from_bytes(view[len(CONTAINER_MAGIC) : start], "little")
    if end > len(view):
        raise pickle.UnpicklingError("the container's pickle runs past its end")
    unpickler = _Unpickler(view, end)
    value = unpickler.load()
    if unpickler.position != len(view):
        raise pickle.UnpicklingError(
            f"the container's storages end at byte {unpickler.position} of {len(view)}"
        )
    return value


class _Unpickler(pickle.Unpickler):
    """Builds plain values and tensors; refuses every other class."""

    def __init__(self, view: memoryview, end: int) -> None:
        start = len(CONTAINER_MAGIC) + _LENGTH_BYTES
        super().__init__(io.BytesIO(view[start:end]))
        self._view = view
        self.position = end
        self._storages: list[torch.UntypedStorage] = []
        self._tensors: list[torch.Tensor] = []

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None and module == "torch":
            dtype = getattr(torch, name, None)
            found = dtype if isinstance(dtype, torch.dtype) else None
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a plain value")
        return found

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "again":
            index = pid[1]
            if type(index) is not int or not 0 <= index < len(self._tensors):
                raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
            return self._tensors[index]
        try:
            kind, number, nbytes, dtype_name, shape, stride, offset, grad, parameter = pid
        except (TypeError, ValueError):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}") from None
        dtype = getattr(torch, str(dtype_name), None)
        if kind != "tensor" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        storage = self._storage(number, nbytes)
        if not _fits(shape, stride, offset, dtype.itemsize, storage.nbytes()):
            raise pickle.UnpicklingError(
                f"a tensor of shape {shape}, strides {stride} at {offset} does not fit its "
                f"storage of {storage.nbytes()} bytes"
            )
        tensor = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
        if parameter:
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(grad))
        else:
            tensor.requires_grad_(bool(grad))
        self._tensors.append(tensor)
        return tensor

    def _storage(self, number: Any, nbytes: Any) -> torch.UntypedStorage:
        if number == len(self._storages) and type(nbytes) is int and nbytes >= 0:
            if self.position + nbytes > len(self._view):
                raise pickle.UnpicklingError("a storage runs past the end of the container")
            if nbytes:
                storage = torch.UntypedStorage.from_buffer(
                    self._view, "native", count=nbytes, offset=self.position, dtype=torch.uint8
                )
            else:
                storage = torch.UntypedStorage(0)
            self.position += nbytes
            self._storages.append(storage)
            return storage
        if type(number) is int and 0 <= number < len(self._storages):
            if self._storages[number].nbytes() == nbytes:
                return self._storages[number]
        raise pickle.UnpicklingError(f"storage {number!r} of {nbytes!r} bytes is out of order")


def _fits(shape: Any, stride: Any, offset: Any, itemsize: int, nbytes: int) -> bool:
    """Whether a tensor of these dimensions lies within a storage of ``nbytes`` bytes."""
    numbers = (*shape, *stride, offset)
    if not all(type(n) is int and n >= 0 for n in numbers) or len(shape) != len(stride):
        return False
    if 0 in shape:
        return True
    last = offset + sum((size - 1) * step for size, step in zip(shape, stride))
    return (last + 1) * itemsize <= nbytes
