"""Fusion planning: which agreed collectives run together in one buffer.

A pure function of the cycle's agreed responses (in the agreed order, identical on every
rank) and the threshold, so every rank makes the same plan. Allreduces with the same process
set, dtype, reduce op, scale factors and device share a unit while the unit's bytes stay
within ``HOROVOD_FUSION_THRESHOLD``; everything else (other collectives, errors, Adasum,
allreduces submitted with ``fuse=False``, grouped allreduces when group fusion is disabled,
and single CPU tensors as large as their process set's ``unfused`` size, which are cheaper
reduced alone than copied in and out of the fusion buffer) runs alone. Units keep the order
of their first entry, with one exception: a large CPU tensor that runs alone goes ahead of
the fused units of its process set that the cycle's earlier entries opened (up to that set's
previous unit of any other kind), so that its transfer, which the link spends most of a step
on, starts first, and the small tensors' calls follow it. Over a slow link a small call made
while the backward pass keeps every core busy takes milliseconds during which the link would
otherwise idle. Entries keep their order inside a unit. Every member of a set sees the same
entries of that set, so every member makes the same moves.

A training step's cycles repeat: the response cache hands out the same responses, in the
same order, step after step. :class:`FusionPlans` keeps the plans of recent cycles by the
identity of their responses, so a recurring cycle reuses its plan instead of making it again
(planning costs a few microseconds per entry, as much as submitting it).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import NamedTuple, TypeVar

import torch

from baguahvd.common.ops import ReduceOp
from baguahvd.engine.messages import DTYPES, OpType, Response
from baguahvd.engine.process_sets import ProcessSetState

ITEMSIZES = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}
"""Bytes per element, by dtype name."""

Own = TypeVar("Own")
"""What an entry carries beside its response (this rank's request, or None)."""

_ALLREDUCE = OpType.ALLREDUCE
_ADASUM = ReduceOp.ADASUM


def plan_fusion(
    entries: Sequence[tuple[Response, Own]],
    threshold: int,
    disable_group_fusion: bool = False,
    unfused: Mapping[int, int] | None = None,
) -> list[list[tuple[Response, Own]]]:
    """Splits ``entries`` into units that each run as one collective (see module docstring).

    Args:
        entries: the agreed responses, each with what this rank holds for it.
        threshold: bytes per fused unit; 0 or less fuses nothing.
        disable_group_fusion: HOROVOD_DISABLE_GROUP_FUSION: grouped allreduces run alone.
        unfused: per process set id, the bytes from which a single CPU tensor runs alone
            (missing or 0: never).
    """
    if threshold <= 0 or len(entries) < 2:
        return [[entry] for entry in entries]
    units: list[list[tuple[Response, Own]]] = []
    # Per fusion key, the unit still open for more tensors and its bytes so far.
    open_units: dict[tuple[object, ...], tuple[list[tuple[Response, Own]], int]] = {}
    # The units of small allreduces (by id), which a large tensor run alone may pass.
    fused: set[int] = set()
    prod = math.prod
    for entry in entries:
        response = entry[0]
        shapes = response.meta.shapes
        if (
            response.meta.op != _ALLREDUCE
            or response.error is not None
            or response.meta.reduce_op == _ADASUM
            or not response.meta.fuse
            or (disable_group_fusion and len(shapes) > 1)
        ):
            units.append([entry])
            continue
        key = (
            response.meta.process_set_id,
            response.meta.dtype,
            response.meta.reduce_op,
            response.meta.prescale,
            response.meta.postscale,
            response.meta.device,
        )
        count = prod(shapes[0]) if len(shapes) == 1 else sum(map(prod, shapes))
        nbytes = count * ITEMSIZES[response.meta.dtype]
        if unfused and len(shapes) == 1 and response.meta.device == "CPU":
            alone = unfused.get(response.meta.process_set_id, 0)
            if 0 < alone <= nbytes:
                _insert_ahead(units, [entry], fused, response.meta.process_set_id)
                continue
        found = open_units.get(key)
        if found is not None and found[1] + nbytes <= threshold:
            found[0].append(entry)
            open_units[key] = (found[0], found[1] + nbytes)
        else:
            unit = [entry]
            units.append(unit)
            fused.add(id(unit))
            open_units[key] = (unit, nbytes)
    return units


class FusionPlans:
    """:func:`plan_fusion` with the plans of the last :attr:`KEPT` cycles of
    :attr:`MIN_ENTRIES` entries or more kept, each under the identity of its responses and
    the arguments (see module docstring).

    A kept plan holds its responses, so their ids cannot be reused by other objects while it
    is kept: the same ids in the same order are the same responses, and a response is never
    changed (a tuple), so the plan made for them is the plan for them.
    """

    KEPT = 8
    MIN_ENTRIES = 16

    def __init__(self) -> None:
        self._plans: OrderedDict[tuple[object, ...], _Kept] = OrderedDict()

    def plan(
        self,
        entries: Sequence[tuple[Response, Own]],
        threshold: int,
        disable_group_fusion: bool = False,
        unfused: Mapping[int, int] | None = None,
    ) -> list[list[tuple[Response, Own]]]:
        """What :func:`plan_fusion` returns for these arguments."""
        if len(entries) < self.MIN_ENTRIES:
            return plan_fusion(entries, threshold, disable_group_fusion, unfused)
        responses = tuple([entry[0] for entry in entries])
        key = (
            threshold, disable_group_fusion, tuple(unfused.items()) if unfused else (),
            *map(id, responses),
        )
        kept = self._plans.get(key)
        if kept is None:
            # Planned with each entry's position in place of what it carries.
            units = plan_fusion(
                list(zip(responses, range(len(responses)))), threshold, disable_group_fusion,
                unfused,
            )
            kept = _Kept(responses, [[index for _, index in unit] for unit in units])
            self._plans[key] = kept
            if len(self._plans) > self.KEPT:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return [[entries[index] for index in unit] for unit in kept.units]


class _Kept(NamedTuple):
    responses: tuple[Response, ...]
    """Kept alive, so that their ids name them (see :class:`FusionPlans`)."""
    units: list[list[int]]
    """The plan, as positions in the cycle's entries."""


def _insert_ahead(
    units: list[list[tuple[Response, Own]]], unit: list[tuple[Response, Own]],
    fused: set[int], process_set_id: int,
) -> None:
    """Inserts ``unit`` before the fused units of ``process_set_id`` at the end of ``units``
    (units of other sets in between are passed over, another unit of the set stops it)."""
    position = len(units)
    for index in range(len(units) - 1, -1, -1):
        other = units[index]
        if other[0][0].meta.process_set_id != process_set_id:
            continue
        if id(other) not in fused:
            break
        position = index
    units.insert(position, unit)


def unfused_sizes(
    process_sets: Mapping[int, ProcessSetState], configured: int | None
) -> dict[int, int]:
    """Per process set this rank belongs to, the bytes from which a single CPU tensor runs
    alone: ``configured`` (BAGUAHVD_UNFUSED_BYTES) when set, else its communicator's own
    :attr:`~baguahvd.backends.base.Communicator.unfused_bytes`."""
    return {
        ident: configured if configured is not None else (state.comm.unfused_bytes or 0)
        for ident, state in process_sets.items()
        if state.comm is not None
    }
