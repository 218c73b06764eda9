"""A read-only attribute of the engine that shows what one of its parts keeps."""

from __future__ import annotations

import operator
from typing import Generic, TypeVar

T = TypeVar("T")


class View(Generic[T]):
    """A read-only attribute of the engine that shows what one of its parts keeps (the
    lifecycle's state, the engine thread's counts and settings): user threads read it, the
    part that owns it changes it."""

    __slots__ = ("_get",)

    def __init__(self, path: str) -> None:
        self._get = operator.attrgetter(path)

    def __get__(self, engine: object, owner: type | None = None) -> T:
        if engine is None:  # looked up on the class (documentation tools)
            return self  # type: ignore[return-value]
        return self._get(engine)  # type: ignore[no-any-return]
