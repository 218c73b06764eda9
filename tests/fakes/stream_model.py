"""A stream model of the CUDA runtime, for tests without a GPU.

CPU tensors stand for device memory. While :meth:`StreamModel.active` is entered in a thread,
every torch operation of that thread is an operation queued on the thread's current model
stream: it reads its tensor arguments and writes the ones its schema marks as written (and
its fresh outputs). Each storage remembers its last writer (stream and position) and the
readers since then, and the device it was allocated on.

Ordering is happens-before, as in CUDA: a stream's operations are ordered among themselves;
``Event.record`` snapshots the recording stream's clock at that point of its queue;
``Stream.wait_event`` merges the snapshot into the waiting stream's clock; the host learns a
stream's progress only from ``Event.done`` answering True or a synchronize. Every access is
checked against those clocks when it is queued, which covers every interleaving at once:

- a read on one stream of a buffer last written on another, without an event between them;
- a write while an earlier read or write on another stream may still be running;
- a host read (:meth:`StreamModel.host_read`) of a result before the host synchronized with
  the stream that produced it;
- an allocation that reuses the address of a freed buffer that another stream may still use
  (the caching allocator's hazard; ``record_stream`` declares such a use);
- a CuPy call made while the thread's CuPy device is not the process's device, or memory
  allocated on another GPU (a CUDA context on the wrong GPU);
- an operation that mixes host tensors and device tensors (as torch refuses on a GPU).

Factory functions take ``device="cuda:N"`` (the model allocates host memory and remembers
N); ``device="cpu"`` (what a stand-in's ``.device`` says) means the process's GPU. A factory
called without a device makes host memory, as on a GPU machine; so does what
:meth:`StreamModel.mark_host` marks. The model does not order host memory. A tensor the model has
not seen before is device memory on the process's GPU.

A violation raises :class:`StreamViolation` at once. The queues themselves run later: each
poll of an event runs one queued operation of a stream chosen by a seeded random generator
(only operations whose waits are satisfied), so completion is observed in varying orders.

Simulated time, for measuring overlap. :attr:`StreamModel.cost` gives each queued operation
a duration (by its name: a torch operation's, ``"nccl.allReduce"``...; zero unless a test
sets it). Each operation is placed in time when it is queued, as a GPU would run it: it
starts once its stream has finished the operation before it, once the event it waits for
(if any) has fired, and not before the host time of the thread that queued it; it ends its
duration later. Streams run side by side, so compute on one stream and NCCL on another
overlap unless an event orders them. A thread's host time starts at zero and moves to an
event's time when the thread sees the event fire (a poll that answers True, a
synchronize): work queued after the host waited for something starts after it.
:attr:`ModelStream.free_at` is when a stream's last queued operation ends and
:attr:`ModelStream.busy` the total duration of its operations.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from baguahvd.backends import cuda_support
from tests.fakes.fake_cupy import FakeCupy, stream_protocol_handle

Clock = dict[int, int]
Access = tuple[int, int]
"""(stream id, position in that stream's queue)."""


class StreamViolation(AssertionError):
    """A stream-ordering bug the model found."""


@dataclass
class ModelStream:
    ident: int
    ptr: int
    name: str
    clock: Clock = field(default_factory=dict)
    queue: list[tuple[int, ModelEvent | None]] = field(default_factory=list)
    ran: int = 0
    free_at: float = 0.0
    """Simulated time at which the last queued operation ends."""
    busy: float = 0.0
    """Simulated time spent running the queued operations."""

    @property
    def position(self) -> int:
        return self.clock.get(self.ident, 0)


@dataclass
class ModelEvent:
    stream: ModelStream | None = None
    position: int = 0
    clock: Clock = field(default_factory=dict)
    time: float = 0.0
    """Simulated time at which it fires."""


HOST = -1
"""The device of host memory."""

# Operations that may take tensors of two devices.
_CROSS_DEVICE = ("copy_", "_to_copy", "lift_fresh", "_local_scalar_dense", "_copy_from")


@dataclass
class Buffer:
    device: int
    stream: int
    nbytes: int
    writer: Access | None = None
    readers: list[Access] = field(default_factory=list)
    recorded: set[int] = field(default_factory=set)


def _merge(into: Clock, other: Clock) -> None:
    for key, value in other.items():
        if into.get(key, 0) < value:
            into[key] = value


class StreamModel:
    """The model; :meth:`install` patches CuPy and the backend's torch-stream functions.

    Args:
        device: the process's GPU (``torch.cuda.set_device(device)`` on the main thread).
        seed: orders the queued work as it runs.
        api: the CuPy release whose API the model's CuPy speaks (see :class:`FakeCupy`).
    """

    def __init__(self, device: int = 0, seed: int = 0, api: int = 14) -> None:
        self.device = device
        self.random = random.Random(seed)
        self.host: Clock = {}
        self.streams: dict[int, ModelStream] = {}
        self.buffers: dict[int, Buffer] = {}
        self._ptrs = itertools.count(0x9000)
        self._allocations = itertools.count(0x100000, 0x200)
        self._local = threading.local()
        self.lock = threading.RLock()
        self.cost: Callable[[str], float] = lambda name: 0.0
        """The simulated duration of a queued operation, by name (see module docstring)."""
        self.default = self.stream("default")
        self.fake = FakeCupy(api=api)
        self._patch_cupy()

    # -- streams, threads, devices -------------------------------------------------------

    def stream(self, name: str = "") -> ModelStream:
        ptr = next(self._ptrs)
        stream = ModelStream(len(self.streams) + 1, ptr, name or hex(ptr))
        self.streams[ptr] = stream
        return stream

    def current(self) -> ModelStream:
        return getattr(self._local, "stream", None) or self.default

    @contextmanager
    def use(self, stream: ModelStream) -> Iterator[None]:
        """``torch.cuda.stream(stream)`` for this thread."""
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def torch_device(self) -> int:
        return getattr(self._local, "torch_device", 0)

    def cupy_device(self) -> int:
        return getattr(self._local, "cupy_device", 0)

    def check_cupy_device(self, what: str) -> None:
        if self.cupy_device() != self.device:
            raise StreamViolation(
                f"{what} ran with CuPy's device {self.cupy_device()} in a thread of a process "
                f"that uses cuda:{self.device}"
            )

    # -- accesses ---------------------------------------------------------------------------

    def host_time(self) -> float:
        """This thread's simulated host time (see module docstring)."""
        return getattr(self._local, "now", 0.0)

    def _step(self, stream: ModelStream, waits: ModelEvent | None = None,
              name: str = "") -> Access:
        with self.lock:
            _merge(stream.clock, self.host)
            position = stream.position + 1
            stream.clock[stream.ident] = position
            stream.queue.append((position, waits))
            duration = self.cost(name) if name else 0.0
            start = max(stream.free_at, self.host_time(), waits.time if waits else 0.0)
            stream.free_at = start + duration
            stream.busy += duration
            return stream.ident, position

    def _ordered(self, access: Access, clock: Clock) -> bool:
        return clock.get(access[0], 0) >= access[1]

    def _name(self, ident: int) -> str:
        return next(s.name for s in self.streams.values() if s.ident == ident)

    def buffer(self, tensor: torch.Tensor, device: int | None = None) -> Buffer:
        storage = tensor.untyped_storage()
        found = self.buffers.get(storage.data_ptr())
        if found is None:
            self._forget_overlapping(storage.data_ptr(), storage.nbytes())
            found = Buffer(self.device if device is None else device, self.default.ident,
                           storage.nbytes())
            self.buffers[storage.data_ptr()] = found
        return found

    def _forget_overlapping(self, start: int, nbytes: int) -> None:
        """Drops the buffers of freed memory that a new buffer at ``start`` overlaps
        without starting where it starts: tensors are host memory here, which the
        allocator hands out again at other offsets (two ranks' threads share it), and
        :meth:`at` would otherwise find the stale buffer and its writer first."""
        end = start + max(nbytes, 1)
        for other in [
            ptr for ptr, buffer in self.buffers.items()
            if ptr != start and ptr < end and start < ptr + max(buffer.nbytes, 1)
        ]:
            del self.buffers[other]

    def mark_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Marks ``tensor`` as host memory."""
        self.buffer(tensor).device = HOST
        return tensor

    def device_of(self, tensor: torch.Tensor) -> int:
        """The model's device of ``tensor``: a GPU index or :data:`HOST`."""
        return self.buffer(tensor).device

    def at(self, pointer: int) -> Buffer:
        for start, buffer in self.buffers.items():
            if start <= pointer < start + max(buffer.nbytes, 1):
                return buffer
        raise StreamViolation(f"the address {pointer:#x} is not in a buffer the model knows")

    def read(self, buffer: Buffer, stream: ModelStream, access: Access, what: str) -> None:
        if buffer.device == HOST:
            return
        if buffer.writer is not None and not self._ordered(buffer.writer, stream.clock):
            raise StreamViolation(
                f"{what} on stream {stream.name} reads a buffer written on stream "
                f"{self._name(buffer.writer[0])} with no event ordering it after the write"
            )
        buffer.readers.append(access)

    def write(self, buffer: Buffer, stream: ModelStream, access: Access, what: str) -> None:
        if buffer.device == HOST:
            return
        for earlier in [buffer.writer, *buffer.readers]:
            if earlier is not None and not self._ordered(earlier, stream.clock):
                raise StreamViolation(
                    f"{what} on stream {stream.name} writes a buffer that stream "
                    f"{self._name(earlier[0])} may still be using"
                )
        buffer.writer, buffer.readers = access, []

    def allocate(
        self, tensor: torch.Tensor, stream: ModelStream, access: Access, device: int
    ) -> None:
        if device not in (HOST, self.device):
            raise StreamViolation(
                f"memory allocated on cuda:{device} in a process that uses cuda:{self.device}"
            )
        storage = tensor.untyped_storage()
        old = self.buffers.get(storage.data_ptr())
        if old is not None and old.device != HOST:
            owner = next(s for s in self.streams.values() if s.ident == old.stream)
            for earlier in [old.writer, *old.readers]:
                if earlier is None or earlier[0] == old.stream or earlier[0] in old.recorded:
                    continue
                if not self._ordered(earlier, owner.clock):
                    raise StreamViolation(
                        f"memory freed on stream {owner.name} was reused while stream "
                        f"{self._name(earlier[0])} may still use it (record_stream missing)"
                    )
        self._forget_overlapping(storage.data_ptr(), storage.nbytes())
        self.buffers[storage.data_ptr()] = Buffer(
            device, stream.ident, storage.nbytes(), writer=access
        )

    def host_read(self, tensor: torch.Tensor) -> None:
        """The host looks at ``tensor``'s memory (as ``.numpy()`` of pinned memory would)."""
        buffer = self.buffer(tensor)
        if buffer.writer is not None and not self._ordered(buffer.writer, self.host):
            raise StreamViolation(
                f"the host read a result of stream {self._name(buffer.writer[0])} before "
                "synchronizing with it"
            )

    def settled_for(self, tensor: torch.Tensor, stream: ModelStream) -> bool:
        """Whether every access made so far to ``tensor``'s memory is ordered before the
        work ``stream`` queues next, which may then overwrite it."""
        buffer = self.buffer(tensor)
        clock = dict(stream.clock)
        _merge(clock, self.host)  # what the host waited for comes before its next launch
        return all(
            self._ordered(access, clock)
            for access in [buffer.writer, *buffer.readers] if access is not None
        )

    def record_stream(self, tensor: torch.Tensor, stream: ModelStream) -> None:
        self.buffer(tensor).recorded.add(stream.ident)

    # -- events and the queues running ------------------------------------------------------

    def record(self, event: ModelEvent, stream: ModelStream) -> None:
        self._step(stream)
        event.stream, event.position, event.clock = stream, stream.position, dict(stream.clock)
        event.time = stream.free_at

    def wait(self, stream: ModelStream, event: ModelEvent) -> None:
        self._step(stream, waits=event)
        _merge(stream.clock, event.clock)

    def _runnable(self, stream: ModelStream) -> bool:
        if stream.ran >= len(stream.queue):
            return False
        waits = stream.queue[stream.ran][1]
        return waits is None or waits.stream is None or waits.stream.ran >= waits.position

    def run_one(self) -> bool:
        """Runs one queued operation of a randomly chosen stream; False when none can run."""
        with self.lock:
            ready = [s for s in self.streams.values() if self._runnable(s)]
            if not ready:
                return False
            self.random.choice(ready).ran += 1
            return True

    def query(self, event: ModelEvent) -> bool:
        self.run_one()
        if event.stream is None or event.stream.ran >= event.position:
            _merge(self.host, event.clock)
            self._local.now = max(self.host_time(), event.time)
            return True
        return False

    def synchronize(self, event: ModelEvent) -> None:
        while not self.query(event):
            if not self.run_one() and not self.query(event):
                raise StreamViolation("an event can never fire: its stream waits forever")

    def synchronize_stream(self, stream: ModelStream) -> None:
        event = ModelEvent()
        self.record(event, stream)
        self.synchronize(event)

    # -- installing -------------------------------------------------------------------------

    @contextmanager
    def active(self) -> Iterator[None]:
        """Every torch operation of this thread runs on its current model stream."""
        with _Factories(self), _Mode(self):
            yield

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Installs the fake CuPy and points the CUDA helpers of
        :mod:`baguahvd.backends.cuda_support`, which the NCCL backend and the engine call, at
        the model's streams and devices."""
        self.fake.install(monkeypatch)
        # Factory functions with device="cuda" reach the model's dispatch mode.
        monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: model.torch_device())
        model = self

        def current_stream_ptr(device: torch.device) -> int:
            return model.current().ptr

        @contextmanager
        def on_stream(device: torch.device, ptr: int) -> Iterator[None]:
            # torch.cuda.stream also makes the stream's device the current one meanwhile.
            previous = model.torch_device()
            model._local.torch_device = device.index
            try:
                with model.use(model.streams[ptr]):
                    yield
            finally:
                model._local.torch_device = previous

        def set_torch_device(device: torch.device) -> None:
            model._local.torch_device = device.index

        def tensor_device(tensor: torch.Tensor) -> torch.device:
            return torch.device("cuda", model.device_of(tensor))

        replacements: dict[str, Any] = {
            "current_stream_ptr": current_stream_ptr,
            "on_stream": on_stream,
            "set_torch_device": set_torch_device,
            "new_stream": lambda device: model.stream("side").ptr,
            "record_stream": lambda tensor, device, ptr: model.record_stream(
                tensor, model.streams[ptr]
            ),
            "thread_cuda_device": lambda: torch.device("cuda", model.torch_device()),
            "tensor_device": tensor_device,
            "is_cuda": lambda tensor: model.device_of(tensor) != HOST,
        }
        # Every caller reaches these helpers through cuda_support.
        for name, replacement in replacements.items():
            monkeypatch.setattr(cuda_support, name, replacement)

    def main_thread(self) -> None:
        """What a training script does first: ``torch.cuda.set_device(local_rank)``."""
        self._local.torch_device = self.device
        self._local.cupy_device = self.device

    def _patch_cupy(self) -> None:
        model = self
        fake = self.fake
        cuda = fake.cupy.cuda
        conforming = fake.conforming

        class Device:
            @conforming("cuda.Device")
            def __init__(self, device: Any = None) -> None:
                self.id = 0 if device is None else int(device)

            @conforming("cuda.Device.use")
            def use(self) -> None:
                model._local.cupy_device = self.id

            def __enter__(self) -> Device:
                self._previous = model.cupy_device()
                self.use()
                return self

            def __exit__(self, *exc: object) -> None:
                model._local.cupy_device = self._previous

        class Event:
            @conforming("cuda.Event")
            def __init__(self, block: bool = False, disable_timing: bool = False,
                         interprocess: bool = False) -> None:
                model.check_cupy_device("cupy.cuda.Event()")
                self.model = ModelEvent()

            @conforming("cuda.Event.record")
            def record(self, stream: Any = None) -> None:
                model.check_cupy_device("Event.record")
                target = model.current() if stream is None else model.streams[stream.ptr]
                model.record(self.model, target)

            @property
            def done(self) -> bool:
                model.check_cupy_device("Event.done")
                return model.query(self.model)

            @conforming("cuda.Event.synchronize")
            def synchronize(self) -> None:
                model.synchronize(self.model)

        class Stream:
            @conforming("cuda.Stream")
            def __init__(self, null: bool = False, non_blocking: bool = False,
                         ptds: bool = False, priority: Any = None) -> None:
                model.check_cupy_device("cupy.cuda.Stream()")
                self.ptr = model.default.ptr if null else model.stream("nccl").ptr

            @conforming("cuda.Stream.wait_event")
            def wait_event(self, event: Event) -> None:
                model.check_cupy_device("Stream.wait_event")
                model.wait(model.streams[self.ptr], event.model)

        def wrapping(ptr: int) -> Stream:
            stream = Stream.__new__(Stream)
            stream.ptr = ptr
            return stream

        def from_external(obj: Any) -> Stream:
            return wrapping(stream_protocol_handle(obj))

        class ExternalStream(Stream):
            @conforming("cuda.ExternalStream")
            def __init__(self, ptr: int, device_id: int = -1) -> None:
                self.ptr = int(ptr)

        if fake.api == 14:
            Stream.from_external = staticmethod(  # type: ignore[attr-defined]
                conforming("cuda.Stream.from_external")(from_external)
            )

        class MemoryPointer:
            def __init__(self, size: int) -> None:
                model.check_cupy_device("cupy.cuda.alloc")
                self.ptr = next(model._allocations)
                model.buffers[self.ptr] = Buffer(model.device, model.current().ident, size)

        @conforming("cuda.alloc")
        def alloc(size: int) -> MemoryPointer:
            return MemoryPointer(size)

        cuda.Device, cuda.Event, cuda.Stream = Device, Event, Stream
        cuda.alloc = alloc
        cuda.ExternalStream = ExternalStream
        communicator = cuda.nccl.NcclCommunicator

        def collective(name: str, sends: tuple[int, ...], recvs: tuple[int, ...]) -> Callable[
            ..., None
        ]:
            logged = getattr(communicator, name)

            def call(self: Any, *args: Any) -> None:
                model.check_cupy_device(f"ncclComm.{name}")
                stream = model.streams[args[-1]]
                access = model._step(stream, name=f"nccl.{name}")
                for index in sends:
                    model.read(model.at(args[index]), stream, access, f"NCCL {name}")
                for index in recvs:
                    model.write(model.at(args[index]), stream, access, f"NCCL {name}")
                logged(self, *args)

            return call

        communicator.allReduce = collective("allReduce", (0,), (1,))
        communicator.reduceScatter = collective("reduceScatter", (0,), (1,))
        communicator.allGather = collective("allGather", (0,), (1,))
        communicator.broadcast = collective("broadcast", (0,), (1,))
        communicator.reduce = collective("reduce", (0,), (1,))
        communicator.send = collective("send", (0,), ())
        communicator.recv = collective("recv", (), (0,))


_FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor,
    torch.arange, torch.rand, torch.randn, torch.linspace,
}


class _Factories(TorchFunctionMode):
    """A factory function called without a device makes host memory."""

    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self.model = model

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _FACTORIES and kwargs.get("device") is None:
            self.model.mark_host(result)
        return result


class _Mode(TorchDispatchMode):
    """Turns torch operations into accesses on the thread's current model stream."""

    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        model = self.model
        schema = func._schema
        written: list[torch.Tensor] = []
        read: list[torch.Tensor] = []
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        for argument, value in zip(schema.arguments, values):
            tensors = [v for v in (value if isinstance(value, (list, tuple)) else [value])
                       if isinstance(v, torch.Tensor)]
            alias = argument.alias_info
            (written if alias is not None and alias.is_write else read).extend(tensors)
        name = func.__name__.split(".")[0]
        # torch.tensor(data, device=...) lifts memory made outside the mode: not a read of
        # device memory but a new buffer, copied from the host on this stream.
        lifted = name == "lift_fresh"
        if lifted:
            read = []
        requested = kwargs.get("device")
        if isinstance(requested, torch.device) and requested.type == "cuda":
            kwargs = {**kwargs, "device": torch.device("cpu")}
        devices = {model.device_of(t) for t in read + written if t.dim() > 0}
        if len(devices) > 1 and name not in _CROSS_DEVICE:
            raise StreamViolation(f"torch {name} mixes tensors of devices {sorted(devices)}")
        if isinstance(requested, torch.device):
            # "cpu" is what a stand-in tensor's .device says: device memory like it.
            device = model.device if requested.type == "cpu" else (
                model.torch_device() if requested.index is None else requested.index
            )
        elif read + written:
            # A 0-dim operand may be a host scalar; the others say where the result lives.
            shaped = [t for t in read + written if t.dim() > 0] or read + written
            device = model.device_of(shaped[0])
        else:
            device = model.device
        result = func(*args, **kwargs)
        stream = model.current()
        with model.lock:
            access = model._step(stream, name=name)
            what = f"torch {name}"
            for tensor in read + written:
                model.read(model.buffer(tensor), stream, access, what)
            inputs = {t.untyped_storage().data_ptr() for t in read + written}
            outputs = result if isinstance(result, (list, tuple)) else [result]
            for tensor in outputs:
                if isinstance(tensor, torch.Tensor):
                    if lifted or tensor.untyped_storage().data_ptr() not in inputs:
                        model.allocate(tensor, stream, access, device)
            for tensor in written:
                model.write(model.buffer(tensor), stream, access, what)
        if name == "_local_scalar_dense" and model.device_of(read[0]) != HOST:
            model.synchronize_stream(stream)
        return result


def installed_model(
    monkeypatch: pytest.MonkeyPatch, device: int, seed: int = 0
) -> StreamModel:
    """A :class:`StreamModel` installed for the test, its main thread on ``device`` (what a
    training script's ``torch.cuda.set_device`` does)."""
    model = StreamModel(device=device, seed=seed)
    model.install(monkeypatch)
    model.main_thread()
    return model


def on_thread(
    model: StreamModel, body: Callable[[], object], grad_enabled: bool = True
) -> None:
    """Runs ``body`` on a new thread on the model (as the engine thread does, which turns
    grad mode off unless ``grad_enabled``), re-raising its error on the caller's thread."""
    errors: list[BaseException] = []

    def target() -> None:
        torch.set_grad_enabled(grad_enabled)
        try:
            with model.active():
                body()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the thread did not finish within 30 s"
    if errors:
        raise errors[0]
