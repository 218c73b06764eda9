"""The in-memory copy a commit takes, into the memory of an earlier copy where it can.

A deep copy of a large CPU state is mostly the kernel's work, not the copy's: every tensor
is new memory that is faulted in and zeroed a page at a time before the bytes arrive (a
100 MB model: 41 ms for ``copy.deepcopy`` of its ``state_dict``, 10 ms for ``copy_`` into
tensors that already exist, on the 2-core VM of ``benchmarks/results/elastic_commit/``).
:func:`copy_state` therefore copies into the tensors of a ``spare``: an earlier copy of the
same layout that nothing reads any more (the caller knows which, see
:meth:`baguahvd.torch.elastic.state.TorchState.save`). Anything it cannot reuse is deep
copied as before, so the result is always a copy that shares nothing with the source.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["copy_state"]


def copy_state(state: Any, spare: Any = None) -> Any:
    """A deep copy of ``state`` (nested dicts, lists and tuples of tensors and plain values,
    as ``state_dict()`` returns), written into the tensors of ``spare`` where ``spare``
    holds a tensor at the same place that can take it (a contiguous CPU tensor of the same
    shape and dtype, for a contiguous CPU source). ``spare``'s tensors must be read by
    nobody else: they are overwritten. Tensors the source holds twice (tied weights) are
    copied once and held twice, as :func:`copy.deepcopy` does, and each of ``spare``'s
    tensors takes one source at most."""
    return _Copy().of(state, spare)


class _Copy:
    """One :func:`copy_state`: what it has copied (by the source's id, as
    :func:`copy.deepcopy`'s memo) and which of the spare's tensors it has used."""

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}
        self.used: set[int] = set()

    def of(self, value: Any, spare: Any) -> Any:
        if isinstance(value, torch.Tensor):
            found = self.memo.get(id(value))
            if found is not None:
                return found
            if not self._fits(value, spare):
                return copy.deepcopy(value, self.memo)
            with torch.no_grad():
                spare.copy_(value)
            self.memo[id(value)] = spare
            self.used.add(id(spare))
            return spare
        kind = type(value)
        if kind is dict or kind is OrderedDict:
            within = spare if type(spare) is kind else {}
            copied = kind((key, self.of(item, within.get(key))) for key, item in value.items())
            if kind is OrderedDict and vars(value):
                # state_dict()'s _metadata (module versions), which load_state_dict reads.
                vars(copied).update(copy.deepcopy(vars(value), self.memo))
            return copied
        if kind is list or kind is tuple:
            others = spare if type(spare) is kind and len(spare) == len(value) else ()
            items = [self.of(item, others[index] if others else None)
                     for index, item in enumerate(value)]
            return items if kind is list else tuple(items)
        return copy.deepcopy(value, self.memo)

    def _fits(self, value: torch.Tensor, spare: Any) -> bool:
        """Whether ``spare`` can take a copy of ``value`` that is what deep copying gives."""
        return (
            type(value) is torch.Tensor
            and type(spare) is torch.Tensor
            and id(spare) not in self.used
            and spare is not value
            and value.is_cpu
            and spare.is_cpu
            and value.layout is torch.strided
            and not value.is_quantized
            and not value.requires_grad
            and spare.dtype is value.dtype
            and spare.shape == value.shape
            and value.is_contiguous()
            and spare.is_contiguous()
            and not value.is_conj()
            and not value.is_neg()
        )
