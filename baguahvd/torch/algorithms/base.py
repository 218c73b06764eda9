"""The algorithm framework: a config object per algorithm and an implementation with hooks.

An :class:`Algorithm` holds hyperparameters only and validates them when constructed.
``reify(context)`` binds it to a wrapped optimizer and returns an :class:`AlgorithmImpl`,
whose hooks ``DistributedOptimizer`` calls:

- ``on_backward(p)``: the gradient of ``p`` has been accumulated (called during backward);
- ``synchronize()``: before the optimizer step: finish the communication of this step and
  leave its result in ``p.grad`` or in the weights;
- ``step(closure)``: runs the optimizer step (algorithms that replace it override this);
- ``post_step()``: after the optimizer step;
- ``close()``: the optimizer is discarded or baguahvd shuts down.

The defaults implement bucketed gradient communication: gradients are grouped into buckets
(:mod:`baguahvd.torch.algorithms.buckets`) in the same order on every rank, a bucket is launched
as soon as all its gradients are ready and every earlier bucket has been launched, and one
worker thread per optimizer runs the buckets' communication in launch order while backward
continues (for CUDA tensors on a stream of its own, see :class:`Worker`). Gradient
algorithms override :meth:`GradientAlgorithmImpl.communicate`, and those that communicate
something other than the gradients also ``pack`` and ``unpack``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from baguahvd.backends import cuda_support
from baguahvd.runtime.process_sets import ProcessSet
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.algorithms.buckets import Bucket, split_into_buckets

DEFAULT_BUCKET_BYTES = 10 * 1024 * 1024


@dataclasses.dataclass
class AlgorithmContext:
    """What an algorithm is bound to.

    The optimizer is held weakly: an algorithm's threads, and the finalizer that closes it
    once the user drops the optimizer, hold the algorithm, which must not keep the
    optimizer alive.
    """

    optimizer_ref: dataclasses.InitVar[torch.optim.Optimizer]
    """The DistributedOptimizer (an instance of the user's optimizer class)."""
    parameters: list[tuple[str, torch.Tensor]]
    """Trainable parameters with their names, in the wrapped optimizer's order."""
    process_set: ProcessSet
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self, optimizer_ref: torch.optim.Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer_ref)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The DistributedOptimizer (an instance of the user's optimizer class)."""
        optimizer = self._optimizer()
        if optimizer is None:
            raise ReferenceError("the optimizer this algorithm was bound to is gone")
        return optimizer

    @property
    def size(self) -> int:
        return int(self.process_set.size() or 1)

    @property
    def rank(self) -> int:
        return int(self.process_set.rank() or 0)


class Algorithm(abc.ABC):
    """Hyperparameters of a communication algorithm; subclasses validate in ``__init__``."""

    name: ClassVar[str]

    @abc.abstractmethod
    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        """Binds the algorithm to an optimizer."""

    @property
    def activity(self) -> str:
        """The timeline activity drawn around the algorithm's collectives, e.g.
        ``BAGUA_BYTEGRAD``."""
        return f"BAGUA_{self.name.upper()}"

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


Job = Callable[[], Sequence[torch.Tensor] | None]
"""A worker's job; it returns the CUDA tensors it made on the worker's stream for the thread
that waits for it (None when it made none)."""


class SideStreams:
    """The CUDA side of a background thread of an algorithm: before its first CUDA work the
    thread selects the device (torch's and CuPy's), once, and never switches back (that
    would make a CUDA context on another GPU); its work runs on a communication stream of
    its own, one per device, made by the first thread that needs it."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, int] = {}
        self._selected = threading.local()

    def stream(self, device: torch.device) -> int:
        """The handle of the stream for ``device``, called on the thread that will use it."""
        if getattr(self._selected, "device", None) is None:
            cuda_support.set_torch_device(device)
            cuda_support.set_cupy_device(device)
            self._selected.device = device
        ptr = self._streams.get(device)
        if ptr is None:
            ptr = self._streams[device] = cuda_support.new_stream(device)
        return ptr

    @contextlib.contextmanager
    def on(self, device: torch.device | None) -> Iterator[int | None]:
        """Makes the stream for ``device`` this thread's current torch stream (nothing for
        ``None``, host tensors) and yields its handle."""
        if device is None:
            yield None
            return
        ptr = self.stream(device)
        with cuda_support.on_stream(device, ptr):
            yield ptr


class Worker:
    """Runs an algorithm's jobs one after another on a thread of its own.

    The collectives the jobs submit carry the algorithm's timeline activity. Errors are kept
    and re-raised by :meth:`wait`, in the thread that waits.

    CUDA: a job submitted with a CUDA tensor runs on the worker's communication stream
    (:class:`SideStreams`), after an event recorded on the submitting thread's current
    stream when it was submitted; kernels the submitter queues afterwards (the rest of the
    backward pass) run beside it. An event recorded on the worker's stream after each job
    orders the waiting thread's current stream after the results (:meth:`wait`).
    """

    def __init__(self, algorithm: Algorithm) -> None:
        self._activity = algorithm.activity
        self._jobs: queue.Queue[tuple[Job, cuda_support.StreamMark | None] | None] = (
            queue.Queue()
        )
        self._pending = 0
        self._idle = threading.Condition()
        self._error: BaseException | None = None
        self._side = SideStreams()
        # Written by the worker thread under ``_idle``: the event after the last CUDA job
        # on each device, and the tensors jobs made for the waiting thread.
        self._done: dict[torch.device, Any] = {}
        self._made: list[tuple[torch.device, torch.Tensor]] = []
        self._thread = threading.Thread(
            target=self._loop, name=f"baguahvd-{algorithm.name}", daemon=True
        )
        self._thread.start()

    def submit(self, job: Job, tensor: torch.Tensor | None = None) -> None:
        """Queues ``job``. ``tensor`` is one the job communicates, which the submitting thread
        has just written: when it is a CUDA tensor, the job runs on the worker's stream
        after the submitting thread's current stream as it stands now."""
        mark = cuda_support.mark_submission([tensor]) if tensor is not None else None
        with self._idle:
            self._pending += 1
        self._jobs.put((job, mark))

    def wait(self) -> None:
        """Waits until every submitted job has run; then the calling thread's current stream
        is ordered after the jobs' CUDA work. Raises the first job's error."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
            error, self._error = self._error, None
            done, self._done = self._done, {}
            made, self._made = self._made, []
        for device, event in done.items():
            cuda_support.wait_event(device, cuda_support.current_stream_ptr(device), event)
        for device, tensor in made:
            cuda_support.record_stream(tensor, device, cuda_support.current_stream_ptr(device))
        if error is not None:
            raise error

    def close(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        # This thread talks to CUDA while the training thread may capture a CUDA graph.
        cuda_support.relax_capture_mode()
        with runtime.require_engine().activity(self._activity):
            self._run_jobs()

    def _run_jobs(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, mark = item
            try:
                if self._error is None:
                    with torch.no_grad():
                        self._run(job, mark)
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self._error = exc
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _run(self, job: Job, mark: cuda_support.StreamMark | None) -> None:
        if mark is None:
            job()
            return
        device = mark.device
        with self._side.on(device) as ptr:
            assert ptr is not None
            cuda_support.wait_event(device, ptr, mark.ready)
            made: Sequence[torch.Tensor] | None = None
            try:
                made = job()
            finally:
                done = cuda_support.record_event(device, ptr)
                with self._idle:
                    self._done[device] = done
                    self._made.extend((device, tensor) for tensor in made or ())


class AlgorithmImpl:
    """Hooks with working defaults; see the module docstring."""

    def __init__(self, algorithm: Algorithm, context: AlgorithmContext) -> None:
        self.algorithm = algorithm
        self.context = context
        self.step_id = 0
        """Optimizer steps taken so far."""

    def on_backward(self, p: torch.Tensor) -> None:
        """The gradient of ``p`` is ready."""

    def synchronize(self) -> None:
        """Finishes this step's communication before the optimizer step."""

    def step(self, closure: Any, optimizer_step: Callable[[Any], Any]) -> Any:
        """Runs the optimizer step; ``optimizer_step`` is the wrapped optimizer's."""
        return optimizer_step(closure)

    def post_step(self) -> None:
        """Called after every optimizer step."""
        self.step_id += 1

    def close(self) -> None:
        """Stops background work."""


class GradientAlgorithmImpl(AlgorithmImpl):
    """Bucketed gradient communication overlapping backward (see the module docstring)."""

    alignment_by_size: ClassVar[bool] = False
    """Pad every bucket to a multiple of the process-set size (compressed algorithms)."""

    def __init__(self, algorithm: Algorithm, context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.buckets: list[Bucket] = []
        self.rebucket(context.bucket_bytes)
        self._ready: set[int] = set()
        self._next = 0
        self._worker = Worker(algorithm)

    def rebucket(self, bucket_bytes: int) -> None:
        """(Re)builds the buckets at ``bucket_bytes``; only between steps, and on every rank
        after the same step."""
        alignment = self.context.size if self.alignment_by_size else 1
        self.context.bucket_bytes = bucket_bytes
        self.buckets = split_into_buckets(self.context.parameters, bucket_bytes, alignment)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def on_backward(self, p: torch.Tensor) -> None:
        self._ready.add(id(p))
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not all(id(q) in self._ready for q in bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self._next += 1
        self.pack(bucket)
        self._worker.submit(lambda: self.communicate(bucket), bucket.flat)

    def synchronize(self) -> None:
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        try:
            self._worker.wait()
        finally:
            self._next = 0
            self._ready.clear()
        for bucket in self.buckets:
            self.unpack(bucket)

    def pack(self, bucket: Bucket) -> None:
        """Fills ``bucket.flat`` before its communication (on the training thread, buckets
        in order): the gradients by default."""
        bucket.gather_grads()

    def communicate(self, bucket: Bucket) -> None:
        """Reduces ``bucket.flat`` in place across the process set (on the worker thread)."""
        raise NotImplementedError

    def unpack(self, bucket: Bucket) -> None:
        """Writes the communicated ``bucket.flat`` back (in ``synchronize``, after every
        bucket's communication): into the gradients by default."""
        bucket.scatter_grads()

    def close(self) -> None:
        self._worker.close()


def bucket_name(algorithm: Algorithm, bucket: Bucket, part: str = "") -> str:
    """Stable collective name of a bucket (the same on every rank).

    The bucket's first parameter is part of the name, so that the buckets of optimizers
    over different parameters (two models trained by one loss) never share a name.
    """
    suffix = f".{part}" if part else ""
    return f"bagua.{algorithm.name}.bucket{bucket.index}:{bucket.names[0]}{suffix}"


def check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    """Raises ``ValueError`` naming the hyperparameter unless ``value`` is > 0 (or >= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}.")


def check_bool(name: str, value: Any) -> None:
    """Raises ``ValueError`` naming the hyperparameter unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}.")


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raises ``ValueError`` naming the hyperparameter unless ``value`` is an int >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def flat_weights(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters concatenated into one new flat tensor."""
    return torch.cat([p.detach().reshape(-1) for p in params])


def write_weights(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copies consecutive slices of ``flat`` into the parameters."""
    offset = 0
    for p in params:
        count = p.numel()
        p.data.copy_(flat[offset : offset + count].view_as(p))
        offset += count
