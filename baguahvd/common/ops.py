"""Reduction operations, with the integer values Horovod's API exposes."""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """How values from different ranks are combined.

    The members compare equal to Horovod's plain-int constants (``hvd.Sum == 1``), so code that
    passes either form works.
    """

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


def to_reduce_op(op: int | ReduceOp) -> ReduceOp:
    """Converts Horovod's int constants to :class:`ReduceOp`; raises ``ValueError`` otherwise."""
    try:
        return ReduceOp(int(op))
    except (TypeError, ValueError):
        known = ", ".join(f"{m.name.title()}={m.value}" for m in ReduceOp)
        raise ValueError(f"Unknown reduction op {op!r}; expected one of {known}.") from None
