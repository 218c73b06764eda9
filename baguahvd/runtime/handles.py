"""The table that maps the integer handles users hold to engine handles."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from baguahvd.engine.requests import Handle


class HandleTable:
    """Maps the integer handles users hold to engine handles and result builders.

    Used from any user thread without a lock: each operation is one call on a counter or a
    dict, which the interpreter runs atomically.
    """

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self._entries: dict[int, tuple[Handle, Callable[[Handle], Any]]] = {}

    def add(self, handle: Handle, finish: Callable[[Handle], Any]) -> int:
        number = next(self._numbers)
        self._entries[number] = (handle, finish)
        return number

    def get(self, number: int) -> Handle | None:
        entry = self._entries.get(number)
        return None if entry is None else entry[0]

    def pop(self, number: int) -> tuple[Handle, Callable[[Handle], Any]] | None:
        return self._entries.pop(number, None)

    def clear(self) -> None:
        self._entries.clear()
