"""Broadcasting model and optimizer state, and exchanging arbitrary Python objects."""

from __future__ import annotations

from typing import Any

import cloudpickle
import torch

from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.runtime.state import runtime
from baguahvd.torch.mpi_ops import (
    allgather,
    broadcast_,
    broadcast_async_,
    synchronize,
)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrites parameters or buffers on every rank with the root's, in place.

    Args:
        params: ``model.state_dict()`` (any dict; broadcast in sorted key order), or a list
            of tensors or of ``(name, tensor)`` pairs (e.g. ``list(model.named_parameters())``).
        root_rank: the rank whose values everybody takes.

    Raises:
        ValueError: ``params`` is of another type (a generator must be turned into a list).
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            continue
        data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        handles.append(broadcast_async_(data, root_rank, name=name))
    for handle in handles:
        synchronize(handle)


class _Placeholder:
    """Stands for a state tensor while the state's structure is sent as an object."""

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype


def _split_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Placeholder(len(tensors) - 1, value)
    if isinstance(value, dict):
        return {k: _split_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_split_tensors(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_split_tensors(v, tensors) for v in value)
    return value


def _fill_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Placeholder):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_tensors(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_fill_tensors(v, tensors) for v in value)
    return value


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None
) -> None:
    """Makes every rank's optimizer state and hyperparameters equal to the root's.

    Every state tensor (momentum buffers, Adam moments, ...) is broadcast in place of a
    tensor of the root's shape, and every scalar (``lr``, ``betas``, ``step``...) keeps its
    Python type. Unlike Horovod, no optimizer step is taken to create missing state, so the
    root's state and step count are never altered; an optimizer that has not stepped yet
    leaves every rank without state. As after Horovod's step, an optimizer without state
    leaves a zero gradient on every parameter that requires one and had none.

    Args:
        optimizer: the optimizer (plain or ``DistributedOptimizer``).
        root_rank: the rank whose state everybody takes.
        model: accepted for compatibility with Horovod; not needed.

    Raises:
        ValueError: ``optimizer`` is a ``torch.optim.LBFGS``, whose state Horovod refuses to
            broadcast.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state = optimizer.state_dict()
    if not state["state"]:
        _zero_missing_grads(optimizer)
    tensors: list[torch.Tensor] = []
    skeleton = _split_tensors(state, tensors) if runtime.rank() == root_rank else None
    skeleton = broadcast_object(skeleton, root_rank, name="optimizer_state.skeleton")
    if runtime.rank() != root_rank:
        placeholders: list[_Placeholder] = []
        _collect_placeholders(skeleton, placeholders)
        tensors = [
            torch.empty(p.shape, dtype=p.dtype)
            for p in sorted(placeholders, key=lambda p: p.index)
        ]
    handles = [
        broadcast_async_(
            tensor if tensor.is_contiguous() and tensor.device.type == "cpu"
            else tensor.detach().cpu().contiguous(),
            root_rank,
            name=f"optimizer_state.{index}",
        )
        for index, tensor in enumerate(tensors)
    ]
    received = [synchronize(h) for h in handles]
    if runtime.rank() != root_rank:
        optimizer.load_state_dict(_fill_tensors(skeleton, received))


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """Gives every parameter that requires a gradient and has none a zero gradient.

    Horovod takes an optimizer step to create the state of an optimizer that has none,
    which leaves these zero gradients behind; scripts read them (or broadcast them) right
    after. baguahvd leaves the same gradients without stepping. ``SparseAdam`` only takes
    sparse gradients, so it gets sparse zeros.
    """
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zeros = torch.zeros_like(p)
                p.grad = zeros.to_sparse() if sparse else zeros


def _collect_placeholders(value: Any, found: list[_Placeholder]) -> None:
    if isinstance(value, _Placeholder):
        found.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_placeholders(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_placeholders(v, found)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends the root's Python object (pickled with cloudpickle) to every member.

    Returns the root's object on every rank (the root gets ``obj`` itself).
    """
    name = name or type(obj).__name__
    is_root = runtime.rank() == root_rank
    if is_root:
        payload = cloudpickle.dumps(obj)
        length = torch.tensor([len(payload)], dtype=torch.int32)
    else:
        length = torch.zeros(1, dtype=torch.int32)
    broadcast_(length, root_rank, name=f"{name}.sz", process_set=process_set)
    if is_root:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, name=f"{name}.t", process_set=process_set)
    if is_root:
        return obj
    return cloudpickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Returns every rank's object (pickled with cloudpickle), in rank order."""
    name = name or type(obj).__name__
    payload = cloudpickle.dumps(obj)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(
        0, dtype=torch.uint8
    )
    sizes = allgather(torch.tensor([len(payload)], dtype=torch.int32), name=f"{name}.sz")
    gathered = allgather(data, name=f"{name}.t").numpy().tobytes()
    objects = []
    offset = 0
    for size in sizes.tolist():
        objects.append(cloudpickle.loads(gathered[offset : offset + size]))
        offset += size
    return objects


__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]

