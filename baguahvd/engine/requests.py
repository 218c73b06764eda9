"""Handles and requests: what a user thread holds while the engine works on its behalf."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from baguahvd.engine.messages import RequestMeta, Response


class Handle:
    """The future of one submitted collective (its :class:`Request` keeps the tensors alive
    meanwhile, since the engine reads and writes them from its own thread).

    Completion is signalled by releasing a lock taken at creation: much cheaper than an
    Event for the thousands of small requests of a training step.
    """

    __slots__ = ("_pending", "result", "error", "extra", "wakes", "device_done", "finish")

    def __init__(self) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()
        self.result: list[torch.Tensor] | None = None
        self.error: BaseException | None = None
        self.extra: Any = None
        self.wakes: tuple[threading.Event, ...] = ()
        """Set when a thread is about to block in :meth:`wait`: the engine thread then knows
        that a burst of submissions is over and starts its cycle at once (events, so that
        waiting calls nothing of the engine's)."""
        self.device_done: Any = None
        """A CUDA event after the device work that produces the results, where that work
        was queued on the submitter's stream (a single-member set's CUDA tensors):
        :meth:`wait` returns once it has fired, so any stream may read the results."""
        self.finish: Callable[[Handle], Any] | None = None
        """What turns the handle into the value ``synchronize`` returns, once the user
        holds it by number (:class:`~baguahvd.runtime.handles.HandleTable`)."""

    def done(self) -> bool:
        """Whether the collective has finished (successfully or not). Never blocks."""
        return not self._pending.locked()

    def wait(self) -> list[torch.Tensor] | None:
        """Blocks until done; returns the outputs or raises the collective's error."""
        if self._pending.locked():
            for event in self.wakes:
                event.set()
            self._pending.acquire()
            self._pending.release()
        if self.error is not None:
            raise self.error
        if self.device_done is not None:
            self.device_done.synchronize()
        return self.result

    def complete(self, result: list[torch.Tensor] | None, extra: Any = None) -> None:
        self.result = result
        self.extra = extra
        try:  # _release inline: a fused unit completes hundreds
            self._pending.release()
        except RuntimeError:  # already completed by a racing shutdown
            pass

    def fail(self, error: BaseException) -> None:
        if self.done():
            return
        self.error = error
        self._release()

    def _release(self) -> None:
        try:
            self._pending.release()
        except RuntimeError:  # already completed by a racing shutdown
            pass


class Request:
    """A submitted collective on its way through the engine.

    Its description is built once, at submission
    (:meth:`~baguahvd.engine.engine.Engine.submit`), and never changed: ``meta`` (its name,
    op, process set, dtype, shapes, scaling, root, splits...: what the ranks compare and
    agree on), the tensors it reads and writes and its timeline activity. Its progress is
    kept apart: the :class:`Handle` it completes through and, for CUDA tensors, ``mark``,
    noted once before it is queued or run.
    """

    __slots__ = (
        "meta", "inputs", "outputs", "activity", "handle", "submitted", "ident", "mark"
    )

    def __init__(
        self,
        meta: RequestMeta,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None,
        activity: str | None = None,
    ) -> None:
        self.meta = meta
        self.inputs = inputs if type(inputs) is list else list(inputs)
        self.outputs = outputs if outputs is None or type(outputs) is list else list(outputs)
        self.activity = activity
        """The timeline activity drawn around its collective, e.g. ``BAGUA_BYTEGRAD`` (see
        :meth:`baguahvd.engine.engine.Engine.activity`)."""
        self.handle = Handle()
        # When the user submitted it: the stall inspector measures waits from here.
        self.submitted = time.monotonic()
        self.ident = (meta.process_set_id, meta.key)
        """What names it among the requests in flight."""
        self.mark: Any = None
        """Where the submission stands in its submitter's CUDA stream
        (:class:`baguahvd.backends.nccl.StreamMark`), None for CPU tensors."""


Entry = tuple[Response, "Request | None"]
"""An agreed response and this rank's request for it (None where it has none: a joined
rank, or a response this rank only takes part in)."""
