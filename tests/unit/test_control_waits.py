"""Waiting for a started control-plane operation (``baguahvd.backends.base.waits``): poll,
then test between waits that double up to 100 us, handing control back to the caller after
each long one; never a call into the caller."""

from __future__ import annotations

import numpy as np
import pytest

from baguahvd.backends import base
from baguahvd.backends.base import Pending, waits


class _Counted(Pending):
    """Completes at its ``tests``-th test; records its waits and the caller's turns."""

    def __init__(self, tests: int, log: list[object]) -> None:
        self.left = tests
        self.log = log

    def test(self) -> bool:
        self.left -= 1
        return self.left <= 0

    def wait(self, timeout_s: float) -> None:
        self.log.append(timeout_s)

    def result(self) -> np.ndarray:
        return np.zeros(1, dtype=np.uint8)


def _run(pending: _Counted) -> list[object]:
    for _ in waits(pending):
        pending.log.append("turn")
    return pending.log


def test_an_operation_done_at_once_neither_waits_nor_hands_back() -> None:
    assert _run(_Counted(1, [])) == []


def test_waits_double_up_to_100_us_and_the_caller_gets_a_turn_after_each_long_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(base, "SPIN_S", 0.0)  # one test, then the waits
    log = _run(_Counted(10, []))
    assert log == pytest.approx(
        [5e-6, 1e-5, 2e-5, 4e-5, 8e-5, 1e-4, "turn", 1e-4, "turn", 1e-4, "turn"]
    )


def test_the_caller_gives_up_by_no_longer_iterating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "SPIN_S", 0.0)
    pending = _Counted(10**9, [])
    turns = 0
    for _ in waits(pending):
        turns += 1
        if turns == 3:
            break
    assert pending.log.count(1e-4) == 3


def test_the_operation_s_error_reaches_the_caller() -> None:
    class Failed(_Counted):
        def test(self) -> bool:
            raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed"):
        _run(Failed(1, []))
