"""The table that maps the integer handles users hold to engine handles."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from baguahvd.engine.requests import Handle


class HandleTable:
    """Maps the integer handles users hold to engine handles; each engine handle carries the
    builder of the value :func:`~baguahvd.torch.mpi_ops.synchronize` returns
    (:attr:`Handle.finish`), so that an entry is the handle alone: one object less per
    collective in flight for the garbage collector to track.

    Used from any user thread without a lock: each operation is one call on a counter or a
    dict, which the interpreter runs atomically.
    """

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self._entries: dict[int, Handle] = {}

    def add(self, handle: Handle, finish: Callable[[Handle], Any]) -> int:
        handle.finish = finish
        number = next(self._numbers)
        self._entries[number] = handle
        return number

    def get(self, number: int) -> Handle | None:
        return self._entries.get(number)

    def pop(self, number: int) -> Handle | None:
        return self._entries.pop(number, None)

    def clear(self) -> None:
        self._entries.clear()
