"""A stand-in for the part of CuPy that ``baguahvd.backends.nccl`` uses, for tests without a
GPU: ``cupy.cuda.nccl`` (constants with NCCL's own values, unique ids, a communicator that
records its calls, groups, errors) and ``cupy.cuda`` devices, streams and events.

Nothing is computed: every call is appended to one :class:`CallLog`, so a test checks which
NCCL calls were made, with which pointers, counts and types, and in which order with the
stream and event operations around them.
"""

from __future__ import annotations

import itertools
import sys
import threading
import types
from typing import Any

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
    """

    def __init__(self, version: int = 21805, bfloat16: bool = True) -> None:
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
        self.cupy = self._build(bfloat16)

    # -- installing ----------------------------------------------------------------------

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Makes ``import cupy`` / ``import cupy.cuda.nccl`` find the fake."""
        monkeypatch.setitem(sys.modules, "cupy", self.cupy)
        monkeypatch.setitem(sys.modules, "cupy.cuda", self.cupy.cuda)
        monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", self.cupy.cuda.nccl)

    # -- the modules -----------------------------------------------------------------------

    def _build(self, bfloat16: bool) -> types.ModuleType:
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

            allReduce = recorder("allReduce")
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
        nccl = _module(
            "cupy.cuda.nccl",
            **names,
            **NCCL_OPS,
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
