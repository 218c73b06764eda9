"""A stand-in for the part of CuPy that ``baguahvd.backends.nccl`` uses, for tests without a
GPU: ``cupy.cuda.nccl`` (constants with NCCL's own values, unique ids, a communicator that
records its calls, groups, errors) and ``cupy.cuda`` devices, streams and events.

Every call is appended to one :class:`CallLog`, so a test checks which NCCL calls were made,
with which pointers, counts and types, and in which order with the stream and event
operations around them. Nothing is communicated: a reduction leaves its buffers as they were,
as if the other ranks had sent zeros, except an ``allReduce`` with ``NCCL_AVG``, which writes
this rank's values divided by the communicator's size (what zeros from the others would
give), so that averages through ``ncclAvg`` come out like averages built on a sum. Its
pointers must be the addresses of real host memory (the CPU tensors that stand in for CUDA
ones).
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import threading
import types
from typing import Any

import numpy as np
import pytest

# ncclDataType_t and ncclRedOp_t, as in nccl.h.
NCCL_TYPES = {
    "NCCL_INT8": 0,
    "NCCL_UINT8": 1,
    "NCCL_INT32": 2,
    "NCCL_UINT32": 3,
    "NCCL_INT64": 4,
    "NCCL_UINT64": 5,
    "NCCL_FLOAT16": 6,
    "NCCL_FLOAT32": 7,
    "NCCL_FLOAT64": 8,
    "NCCL_BFLOAT16": 9,
}
NCCL_OPS = {"NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}

_FLOAT_TYPES = {6: np.float16, 7: np.float32, 8: np.float64}


def _average_into(send: int, recv: int, count: int, dtype: int, nranks: int) -> None:
    """``recv = send / nranks`` for ``count`` floats of NCCL type ``dtype`` at the host
    addresses ``send`` and ``recv`` (bfloat16 through float32, rounded to nearest even)."""
    if count == 0:
        return
    if dtype == NCCL_TYPES["NCCL_BFLOAT16"]:
        source = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(send))
        target = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(recv))
        wide = (source.astype(np.uint32) << 16).view(np.float32) / np.float32(nranks)
        bits = wide.view(np.uint32)
        target[:] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return
    kind = _FLOAT_TYPES[dtype]
    width = np.dtype(kind).itemsize
    source = np.frombuffer((ctypes.c_char * (count * width)).from_address(send), dtype=kind)
    target = np.frombuffer((ctypes.c_char * (count * width)).from_address(recv), dtype=kind)
    target[:] = source / kind(nranks)


NCCL_STREAM_BASE = 0x5000
"""Handles of the streams the fake creates count up from here."""


class CallLog(list):
    """Every call made on the fake, in order, as tuples ``(name, *arguments)``."""

    def names(self) -> list[str]:
        return [entry[0] for entry in self]

    def of(self, name: str) -> list[tuple[Any, ...]]:
        return [entry for entry in self if entry[0] == name]

    def work(self, name: str) -> list[tuple[Any, ...]]:
        """The calls of ``name`` but the one-byte uint8 allreduce that warms up each new
        communicator (``(name, rank, send, recv, count, dtype, ...)``)."""
        return [entry for entry in self.of(name)
                if not (name == "allReduce" and entry[4:6] == (1, NCCL_TYPES["NCCL_UINT8"]))]


class FakeCupy:
    """Builds the fake modules and holds the knobs that tests turn.

    Args:
        version: what ``nccl.get_version()`` answers.
        bfloat16: whether ``nccl.NCCL_BFLOAT16`` exists (CuPy older than 10 lacks it).
        avg: whether ``nccl.NCCL_AVG`` exists (older CuPy builds do not name it).
    """

    def __init__(self, version: int = 21805, bfloat16: bool = True, avg: bool = True) -> None:
        self.log = CallLog()
        self.version = version
        self.unique_ids = 0
        self.fail_call: str | None = None
        """Name of a communicator method that raises ``NcclError`` when called."""
        self.async_error: int | None = None
        """Status that ``check_async_error`` raises, once set."""
        self.polls_until_done = 0
        """How many ``Event.done`` queries answer False before True; -1: never done."""
        self.communicators: list[Any] = []
        self.blocked: dict[str, threading.Event] = {}
        """Calls that wait, on the calling thread, until their event is set: the
        ``NcclCommunicator`` constructor (a peer that has not called it yet) or a collective
        (its connection setup). ``abort`` sets the events of the collectives, as
        ``ncclCommAbort`` releases a thread waiting inside NCCL."""
        self.allocations = itertools.count(0xA000, 0x200)
        self._stream_ptrs = itertools.count(NCCL_STREAM_BASE)
        self._event_ids = itertools.count(1)
        self.cupy = self._build(bfloat16, avg)

    # -- installing ----------------------------------------------------------------------

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Makes ``import cupy`` / ``import cupy.cuda.nccl`` find the fake."""
        monkeypatch.setitem(sys.modules, "cupy", self.cupy)
        monkeypatch.setitem(sys.modules, "cupy.cuda", self.cupy.cuda)
        monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", self.cupy.cuda.nccl)

    # -- the modules -----------------------------------------------------------------------

    def _build(self, bfloat16: bool, avg: bool) -> types.ModuleType:
        fake = self
        log = self.log

        class NcclError(RuntimeError):
            def __init__(self, status: int) -> None:
                super().__init__(f"NCCL_ERROR_{status}: fake failure")
                self.status = status

        def wait_if_blocked(name: str) -> None:
            gate = fake.blocked.get(name)
            if gate is not None:
                gate.wait()

        def recorder(name: str) -> Any:
            def call(self: Any, *args: Any) -> None:
                log.append((name, self.rank, *args))
                wait_if_blocked(name)
                if fake.fail_call == name:
                    raise NcclError(3)

            return call

        class NcclCommunicator:
            def __init__(self, ndev: int, comm_id: tuple[int, ...], rank: int) -> None:
                assert isinstance(comm_id, tuple) and len(comm_id) == 128
                assert all(-128 <= value < 128 for value in comm_id), "signed chars"
                wait_if_blocked("NcclCommunicator")
                self.ndev = ndev
                self.comm_id = comm_id
                self.rank = rank
                self.aborted = False
                self.destroyed = False
                log.append(("NcclCommunicator", ndev, comm_id, rank))
                fake.communicators.append(self)

            _record_all_reduce = recorder("allReduce")

            def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int,
                          stream: int) -> None:
                self._record_all_reduce(send, recv, count, dtype, op, stream)
                if op == NCCL_OPS["NCCL_AVG"]:
                    _average_into(send, recv, count, dtype, self.ndev)

            reduce = recorder("reduce")
            broadcast = recorder("broadcast")
            bcast = recorder("bcast")
            reduceScatter = recorder("reduceScatter")
            allGather = recorder("allGather")
            send = recorder("send")
            recv = recorder("recv")

            def check_async_error(self) -> None:
                if fake.async_error is not None:
                    raise NcclError(fake.async_error)

            def abort(self) -> None:
                log.append(("abort", self.rank))
                self.aborted = True
                for name, gate in fake.blocked.items():
                    if name != "NcclCommunicator":
                        gate.set()

            def destroy(self) -> None:
                log.append(("destroy", self.rank))
                self.destroyed = True

        def get_unique_id() -> tuple[int, ...]:
            fake.unique_ids += 1
            log.append(("get_unique_id",))
            # Signed chars, as CuPy gives them: the MPI broadcast must keep the sign.
            return tuple([fake.unique_ids, -fake.unique_ids] * 64)

        def get_version() -> int:
            return fake.version

        def group_start() -> None:
            log.append(("groupStart",))

        def group_end() -> None:
            log.append(("groupEnd",))

        names = dict(NCCL_TYPES)
        if not bfloat16:
            del names["NCCL_BFLOAT16"]
        ops = dict(NCCL_OPS)
        if not avg:
            del ops["NCCL_AVG"]
        nccl = _module(
            "cupy.cuda.nccl",
            **names,
            **ops,
            available=True,
            NcclError=NcclError,
            NcclCommunicator=NcclCommunicator,
            get_unique_id=get_unique_id,
            get_version=get_version,
            groupStart=group_start,
            groupEnd=group_end,
        )

        class Device:
            def __init__(self, index: int) -> None:
                self.id = index

            def __enter__(self) -> Device:
                log.append(("Device.enter", self.id))
                return self

            def __exit__(self, *exc: object) -> None:
                log.append(("Device.exit", self.id))

            def use(self) -> None:
                log.append(("Device.use", self.id))

        class Event:
            def __init__(self, block: bool = False, disable_timing: bool = False,
                         interprocess: bool = False) -> None:
                self.id = next(fake._event_ids)
                self.polls = 0

            def record(self, stream: Any = None) -> None:
                log.append(("Event.record", self.id, stream.ptr))

            @property
            def done(self) -> bool:
                log.append(("Event.done", self.id))
                self.polls += 1
                limit = fake.polls_until_done
                return limit >= 0 and self.polls > limit

        class Stream:
            def __init__(self, null: bool = False, non_blocking: bool = False,
                         ptr: int = 0) -> None:
                self.ptr = ptr or next(fake._stream_ptrs)
                self.non_blocking = non_blocking
                log.append(("Stream", self.ptr, non_blocking))

            def wait_event(self, event: Event) -> None:
                log.append(("Stream.wait_event", self.ptr, event.id))

            @classmethod
            def from_external(cls, ptr: int, device_id: int = -1) -> Stream:
                stream = cls.__new__(cls)
                stream.ptr, stream.non_blocking = ptr, False
                return stream

        class ExternalStream(Stream):
            def __init__(self, ptr: int, device_id: int = -1) -> None:
                self.ptr = ptr
                self.non_blocking = False

        class MemoryPointer:
            def __init__(self, size: int) -> None:
                self.ptr = next(fake.allocations)
                log.append(("alloc", self.ptr, size))

        cuda = _module(
            "cupy.cuda", nccl=nccl, Device=Device, Event=Event, Stream=Stream,
            ExternalStream=ExternalStream, alloc=MemoryPointer,
        )
        return _module("cupy", cuda=cuda)


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module
