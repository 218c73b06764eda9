"""A stand-in for the part of CuPy that ``baguahvd.backends.nccl`` uses, for tests without a
GPU: ``cupy.cuda.nccl`` (constants with NCCL's own values, unique ids, a communicator that
records its calls, groups, errors) and ``cupy.cuda`` devices, streams and events.

It speaks the API of a real CuPy release, 14 by default or 13 (``FakeCupy(api=13)``): every
function first checks its arguments against the real signature recorded in
:mod:`tests.fakes.cupy_spec` (checked against the installed CuPy by
``tests/unit/test_cupy_conformance.py``), so it refuses what the real one refuses: a unique
id of the wrong type, an int where a stream object is wanted, a float where a pointer is.
CuPy 14's ``get_unique_id`` gives ``bytes`` and ``Stream.from_external`` takes an object with
``__cuda_stream__``; CuPy 13's gives a tuple of signed chars and has only ``ExternalStream``.

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
import functools
import itertools
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest

from baguahvd.backends import cuda_support
from tests.fakes.cupy_spec import check_call, parameters, signature

_F = TypeVar("_F", bound=Callable[..., Any])

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
        api: the CuPy release whose API the fake speaks, 14 or 13.
    """

    def __init__(
        self, version: int = 21805, bfloat16: bool = True, avg: bool = True, api: int = 14
    ) -> None:
        if api not in (13, 14):
            raise ValueError(f"the fake speaks CuPy 13 or 14, not {api}")
        self.api = api
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

    def conforming(self, name: str) -> Callable[[_F], _F]:
        """Makes a fake function check its arguments against the real ``name`` first."""
        api = self.api
        line = signature(api, name)
        # Methods and constructors get ``self`` first; the real signature line leaves it out
        # of constructors.
        skip = 1 if "(self" in line or name.rsplit(".", 1)[-1][:1].isupper() else 0

        def wrap(function: _F) -> _F:
            @functools.wraps(function)
            def checked(*args: Any, **kwargs: Any) -> Any:
                check_call(api, name, args[skip:], kwargs)
                return function(*args, **kwargs)

            return checked  # type: ignore[return-value]

        return wrap

    def _build(self, bfloat16: bool, avg: bool) -> types.ModuleType:
        fake = self
        log = self.log
        api = self.api
        conforming = self.conforming

        class NcclError(RuntimeError):
            def __init__(self, status: int) -> None:
                super().__init__(f"NCCL_ERROR_{status}: fake failure")
                self.status = status

        def wait_if_blocked(name: str) -> None:
            gate = fake.blocked.get(name)
            if gate is not None:
                gate.wait()

        def recorder(name: str) -> Any:
            order = [param.name for param in parameters(
                signature(api, f"nccl.NcclCommunicator.{name}")
            )]

            @conforming(f"nccl.NcclCommunicator.{name}")
            def call(self: Any, *args: Any, **kwargs: Any) -> None:
                args += tuple(kwargs[key] for key in order[len(args):])
                log.append((name, self.rank, *args))
                wait_if_blocked(name)
                if fake.fail_call == name:
                    raise NcclError(3)

            return call

        class NcclCommunicator:
            @conforming("nccl.NcclCommunicator")
            def __init__(self, ndev: int, commId: Any, rank: int, config: Any = None) -> None:
                if api == 14 and len(commId) != 128:
                    # CuPy 13 does not check the length.
                    raise ValueError(f"commId length {len(commId)} != 128.")
                wait_if_blocked("NcclCommunicator")
                self.ndev = ndev
                self.comm_id = commId
                self.rank = rank
                self.aborted = False
                self.destroyed = False
                log.append(("NcclCommunicator", ndev, commId, rank))
                fake.communicators.append(self)

            _record_all_reduce = recorder("allReduce")

            def allReduce(self, *args: Any, **kwargs: Any) -> None:
                self._record_all_reduce(*args, **kwargs)
                send, recv, count, dtype, op, _ = log[-1][2:]
                if op == NCCL_OPS["NCCL_AVG"]:
                    _average_into(send, recv, count, dtype, self.ndev)

            reduce = recorder("reduce")
            broadcast = recorder("broadcast")
            bcast = recorder("bcast")
            reduceScatter = recorder("reduceScatter")
            allGather = recorder("allGather")
            send = recorder("send")
            recv = recorder("recv")

            @conforming("nccl.NcclCommunicator.check_async_error")
            def check_async_error(self) -> None:
                if fake.async_error is not None:
                    raise NcclError(fake.async_error)

            @conforming("nccl.NcclCommunicator.abort")
            def abort(self) -> None:
                log.append(("abort", self.rank))
                # blocked["abort"]: the abort waits for the device (work queued ahead).
                wait_if_blocked("abort")
                self.aborted = True
                for name, gate in fake.blocked.items():
                    if name not in ("NcclCommunicator", "abort"):
                        gate.set()

            @conforming("nccl.NcclCommunicator.destroy")
            def destroy(self) -> None:
                log.append(("destroy", self.rank))
                self.destroyed = True

        @conforming("nccl.get_unique_id")
        def get_unique_id() -> Any:
            fake.unique_ids += 1
            log.append(("get_unique_id",))
            # Bytes with the high bit set on every other one: the transport must keep them
            # (CuPy 13 hands the same id over as signed chars).
            raw = bytes([fake.unique_ids & 0x7F, 0x80 | (fake.unique_ids & 0x7F)] * 64)
            if api == 13:
                return tuple(value - 256 if value > 127 else value for value in raw)
            return raw

        @conforming("nccl.get_version")
        def get_version() -> int:
            return fake.version

        @conforming("nccl.groupStart")
        def group_start() -> None:
            log.append(("groupStart",))

        @conforming("nccl.groupEnd")
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
            @conforming("cuda.Device")
            def __init__(self, device: Any = None) -> None:
                self.id = 0 if device is None else int(device)

            def __enter__(self) -> Device:
                log.append(("Device.enter", self.id))
                return self

            def __exit__(self, *exc: object) -> None:
                log.append(("Device.exit", self.id))

            @conforming("cuda.Device.use")
            def use(self) -> None:
                log.append(("Device.use", self.id))

        class Event:
            @conforming("cuda.Event")
            def __init__(self, block: bool = False, disable_timing: bool = False,
                         interprocess: bool = False) -> None:
                self.id = next(fake._event_ids)
                self.polls = 0

            @conforming("cuda.Event.record")
            def record(self, stream: Any = None) -> None:
                log.append(("Event.record", self.id, 0 if stream is None else stream.ptr))

            @property
            def done(self) -> bool:
                log.append(("Event.done", self.id))
                self.polls += 1
                limit = fake.polls_until_done
                return limit >= 0 and self.polls > limit

        class Stream:
            @conforming("cuda.Stream")
            def __init__(self, null: bool = False, non_blocking: bool = False,
                         ptds: bool = False, priority: Any = None) -> None:
                self.ptr = 0 if null else next(fake._stream_ptrs)
                self.non_blocking = non_blocking
                log.append(("Stream", self.ptr, non_blocking))

            @conforming("cuda.Stream.wait_event")
            def wait_event(self, event: Event) -> None:
                log.append(("Stream.wait_event", self.ptr, event.id))

            @classmethod
            def _wrapping(cls, ptr: int) -> Stream:
                stream = cls.__new__(cls)
                stream.ptr, stream.non_blocking = ptr, False
                return stream

        def from_external(obj: Any) -> Stream:
            return Stream._wrapping(stream_protocol_handle(obj))

        if api == 14:
            Stream.from_external = staticmethod(  # type: ignore[attr-defined]
                conforming("cuda.Stream.from_external")(from_external)
            )

        class ExternalStream(Stream):
            @conforming("cuda.ExternalStream")
            def __init__(self, ptr: int, device_id: int = -1) -> None:
                if api == 14:
                    warnings.warn(
                        "ExternalStream is deprecated. Use Stream.from_external() instead",
                        DeprecationWarning, stacklevel=2,
                    )
                self.ptr = int(ptr)
                self.non_blocking = False

        @conforming("cuda.alloc")
        def alloc(size: int) -> Any:
            if not isinstance(size, int):
                raise TypeError("an integer is required")
            if size < 0:
                raise OverflowError("can't convert negative value to size_t")
            return MemoryPointer(size)

        class MemoryPointer:
            def __init__(self, size: int) -> None:
                self.ptr = next(fake.allocations)
                log.append(("alloc", self.ptr, size))

        cuda = _module(
            "cupy.cuda", nccl=nccl, Device=Device, Event=Event, Stream=Stream,
            ExternalStream=ExternalStream, alloc=alloc,
        )
        return _module("cupy", cuda=cuda)


def stream_protocol_handle(obj: Any) -> int:
    """The stream handle of an object that implements the CUDA stream protocol, refused as
    CuPy 14's ``Stream.from_external`` refuses it."""
    method = getattr(obj, "__cuda_stream__", None)
    if method is None:
        raise TypeError(
            f"Object of type {type(obj).__name__} does not implement the CUDA stream protocol "
            "(__cuda_stream__ method)"
        )
    answer = method()
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise TypeError("__cuda_stream__() must return a 2-tuple of (version, stream_ptr)")
    return int(answer[1])


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def installed(
    monkeypatch: pytest.MonkeyPatch, device: Any, stream: int = 0x7070, **options: Any
) -> FakeCupy:
    """A :class:`FakeCupy` (``options``) installed for the NCCL backend on CPU tensors that
    stand for CUDA tensors of ``device``: torch's current stream has handle ``stream`` and
    selecting torch's device does nothing."""
    fake = FakeCupy(**options)
    fake.install(monkeypatch)
    monkeypatch.setattr(cuda_support, "tensor_device", lambda tensor: device)
    monkeypatch.setattr(cuda_support, "current_stream_ptr", lambda ptr_device: stream)
    monkeypatch.setattr(cuda_support, "set_torch_device", lambda torch_device: None)
    return fake
