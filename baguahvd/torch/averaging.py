"""The average of every rank's replica, for checkpoints of weight-averaging algorithms.

Decentralized SGD, its low-precision variant and async model averaging leave each rank
with its own weights (and optimizer state). A checkpoint should hold their average, and
the same bytes on every rank: floating-point tensors are averaged with one allreduce per
dtype and then taken from rank 0 with one broadcast (so that ranks agree bit for bit even
where MPI's reduction order differs between them); other tensors (step counters, integer
buffers) are taken from rank 0.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from baguahvd.common.ops import ReduceOp
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.algorithms.async_model_average import AsyncModelAverageAlgorithm
from baguahvd.torch.algorithms.decentralized import DecentralizedAlgorithm
from baguahvd.torch.algorithms.low_precision_decentralized import (
    LowPrecisionDecentralizedAlgorithm,
)
from baguahvd.torch.mpi_ops import allreduce, broadcast

_REPLICA_ALGORITHMS = (
    DecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithm,
    AsyncModelAverageAlgorithm,
)


def keeps_replicas(optimizer: Any) -> bool:
    """Whether ``optimizer`` runs an algorithm that leaves each rank its own weights."""
    return isinstance(getattr(optimizer, "algorithm", None), _REPLICA_ALGORITHMS)


def averaged_state_dict(
    model: torch.nn.Module | Mapping[str, Any], *, name: str = "averaged_state_dict"
) -> dict[str, Any]:
    """Returns the average over all ranks of a model's ``state_dict()``, the same on every
    rank, ready for ``torch.save``.

    Use it to checkpoint a model trained with a weight-averaging algorithm (decentralized,
    low_precision_decentralized, async), whose ranks hold different weights; with any other
    algorithm every rank already holds the same weights and the result equals them.
    Floating-point tensors are averaged; other tensors and non-tensor values come from
    rank 0. The model is not modified. Collective: every rank must call it, with the same
    keys, shapes and dtypes, and the same ``name`` when several calls may be in flight.

    Args:
        model: a module, or a state dict (any nesting of dicts, lists and tuples, such as
            an optimizer's ``state_dict()``).
        name: prefix of the names of the collectives.

    Returns:
        A new state dict of CPU tensors (on the model's devices for CUDA models).

    Example:
        >>> averaged = hvd.averaged_state_dict(model)
        >>> if hvd.rank() == 0:
        ...     torch.save(averaged, "model.pt")
    """
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    return average_tree(dict(state), name)


def average_tree(tree: Any, name: str) -> Any:
    """:func:`averaged_state_dict` for any nesting of dicts, lists and tuples; returns a
    copy with every tensor replaced by its averaged (or rank 0's) value. Collective."""
    leaves: list[torch.Tensor] = []
    _collect(tree, leaves)
    if runtime.size() == 1:
        results = [leaf.detach().clone() for leaf in leaves]
    else:
        results = _average_leaves(leaves, name)
    return _rebuild(tree, iter(results))


def _collect(tree: Any, leaves: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        leaves.append(tree)
    elif isinstance(tree, Mapping):
        for value in tree.values():
            _collect(value, leaves)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _collect(value, leaves)


def _rebuild(tree: Any, results: Iterator[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return next(results)
    if isinstance(tree, Mapping):
        items = [(key, _rebuild(value, results)) for key, value in tree.items()]
        return collections.OrderedDict(items) if isinstance(tree, collections.OrderedDict) \
            else dict(items)
    if isinstance(tree, (list, tuple)):
        rebuilt = [_rebuild(value, results) for value in tree]
        return rebuilt if isinstance(tree, list) else tuple(rebuilt)
    return tree


def _average_leaves(leaves: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    """One flat buffer per (device, dtype): averaged if floating, then rank 0's."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, leaf in enumerate(leaves):
        groups.setdefault((leaf.device, leaf.dtype), []).append(index)
    results: list[torch.Tensor] = list(leaves)
    for (device, dtype), indices in sorted(groups.items(), key=lambda item: str(item[0])):
        key = f"{name}.{device}.{dtype}"
        flat = torch.cat([leaves[i].detach().reshape(-1) for i in indices])
        transport = flat.to(torch.uint8) if dtype == torch.bool else flat
        if dtype.is_floating_point or dtype.is_complex:
            transport = allreduce(transport, name=f"{key}.average", op=ReduceOp.AVERAGE)
        transport = broadcast(transport, 0, name=f"{key}.from_rank_0")
        flat = transport.to(torch.bool) if dtype == torch.bool else transport
        offset = 0
        for i in indices:
            count = leaves[i].numel()
            results[i] = flat[offset : offset + count].view(leaves[i].shape).clone()
            offset += count
    return results


__all__ = ["averaged_state_dict", "average_tree", "keeps_replicas"]
