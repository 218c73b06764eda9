"""Handles and requests: what a user thread holds while the engine works on its behalf."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from baguahvd.engine.messages import RequestMeta


class Handle:
    """The future of one submitted collective.

    It keeps the request's tensors alive until the collective is done, because the engine
    reads and writes them from its own thread.
    """

    __slots__ = ("_done", "name", "result", "error", "extra", "_keepalive")

    def __init__(self, name: str, keepalive: Sequence[torch.Tensor]) -> None:
        self._done = threading.Event()
        self.name = name
        self.result: list[torch.Tensor] | None = None
        self.error: BaseException | None = None
        self.extra: Any = None
        self._keepalive: Sequence[torch.Tensor] | None = keepalive

    def done(self) -> bool:
        """Whether the collective has finished (successfully or not). Never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> list[torch.Tensor] | None:
        """Blocks until done; returns the outputs or raises the collective's error."""
        self._done.wait(timeout)
        if self.error is not None:
            raise self.error
        return self.result

    def complete(self, result: list[torch.Tensor] | None, extra: Any = None) -> None:
        self.result = result
        self.extra = extra
        self._keepalive = None
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._keepalive = None
        self._done.set()


class Request:
    """A submitted collective: its description, its tensors and its handle."""

    __slots__ = ("meta", "inputs", "outputs", "handle")

    def __init__(
        self,
        meta: RequestMeta,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None,
    ) -> None:
        self.meta = meta
        self.inputs = list(inputs)
        self.outputs = None if outputs is None else list(outputs)
        self.handle = Handle(meta.name, [*self.inputs, *(self.outputs or ())])
