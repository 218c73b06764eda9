"""The few places where CuPy's API differs between the releases baguahvd supports (13 and
14), each chosen by what the installed CuPy can do, never by its version string.

- A stream CuPy did not create: CuPy 14 wraps it with ``cupy.cuda.Stream.from_external(obj)``,
  where ``obj`` implements the CUDA stream protocol (``__cuda_stream__`` returns
  ``(version, handle)``); ``cupy.cuda.ExternalStream(ptr, device_id)`` still exists there but
  warns on every construction. CuPy 13 has only ``ExternalStream``.
- The NCCL unique id: ``cupy.cuda.nccl.get_unique_id()`` returns 128 ``bytes`` in CuPy 14
  and a tuple of 128 signed chars in CuPy 13, and ``NcclCommunicator(ndev, commId, rank)``
  takes the same type back (a typed Cython argument: the other type raises ``TypeError``
  before NCCL is called). baguahvd carries the id as ``bytes`` between ranks and converts it
  only at the constructor.

The functions take the ``cupy`` module (or its ``nccl`` module) as an argument; nothing here
imports CuPy.
"""

from __future__ import annotations

from typing import Any

UNIQUE_ID_BYTES = 128
"""Size of ``ncclUniqueId``."""


class StreamHandle:
    """A CUDA stream known by its handle, offered through the CUDA stream protocol."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = int(ptr)

    def __cuda_stream__(self) -> tuple[int, int]:
        # (protocol version, cudaStream_t)
        return 0, self.ptr


def external_stream(cupy: Any, ptr: int, device_index: int = -1) -> Any:
    """CuPy's view of the CUDA stream of handle ``ptr`` on device ``device_index`` (a stream
    CuPy did not create, such as torch's)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(StreamHandle(ptr))
    return cupy.cuda.ExternalStream(int(ptr), int(device_index))


def unique_id_bytes(unique_id: Any) -> bytes:
    """The NCCL unique id as the 128 bytes that travel between ranks, from either form
    ``get_unique_id`` returns.

    Raises:
        ValueError: the id does not have 128 elements.
    """
    if isinstance(unique_id, (bytes, bytearray)):
        raw = bytes(unique_id)
    else:
        raw = bytes(int(value) & 0xFF for value in unique_id)
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(
            f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, this one has {len(raw)}"
        )
    return raw


def signed_chars(raw: bytes) -> tuple[int, ...]:
    """``raw`` as the tuple of signed chars that CuPy 13's ``NcclCommunicator`` takes."""
    return tuple(value - 256 if value > 127 else value for value in raw)


def new_communicator(nccl: Any, size: int, raw_id: bytes, rank: int) -> Any:
    """``nccl.NcclCommunicator(size, id, rank)`` with the id in the type this CuPy takes:
    ``bytes`` first, the tuple of signed chars if the constructor's argument check refuses
    them (it does so before NCCL is called, so nothing is left to undo)."""
    try:
        return nccl.NcclCommunicator(size, raw_id, rank)
    except TypeError as bytes_refused:
        try:
            return nccl.NcclCommunicator(size, signed_chars(raw_id), rank)
        except TypeError:
            raise bytes_refused from None
