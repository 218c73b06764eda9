"""Broadcasting model and optimizer state, and exchanging arbitrary Python objects."""

from __future__ import annotations

import warnings
from typing import Any

import cloudpickle
import torch

from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.runtime.runtime import runtime
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

    Values that are not tensors (a module's ``get_extra_state()`` in its state dict) cannot
    be overwritten in place: they are left as they are, with a warning naming them (Horovod
    fails on them with an ``AttributeError``); send them with :func:`broadcast_object`.

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
    skipped = []
    for index, (name, tensor) in enumerate(items):
        if not isinstance(tensor, torch.Tensor):
            skipped.append(f"{name if name is not None else index} ({type(tensor).__name__})")
            continue
        data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        handles.append(broadcast_async_(data, root_rank, name=name))
    for handle in handles:
        synchronize(handle)
    if skipped:
        warnings.warn(
            "broadcast_parameters left values that are not tensors as they are: "
            f"{', '.join(skipped)}; send them with hvd.broadcast_object.",
            stacklevel=2,
        )


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
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: torch.nn.Module | None = None,
    *,
    initialize_state: bool = True,
) -> None:
    """Makes every rank's optimizer state and hyperparameters equal to the root's.

    As Horovod does, an optimizer without state first gets one: every parameter that
    requires a gradient gets a zero gradient and the optimizer takes one step of its own
    class (a ``DistributedOptimizer`` communicates nothing in it). That step is what an
    optimizer does with a zero gradient: with weight decay it moves the parameters by
    ``lr * weight_decay * p`` and starts SGD's momentum at ``weight_decay * p``, so training
    continues exactly as under Horovod. An optimizer still without state after it (plain
    SGD) is stateless and nothing is broadcast. Then every state tensor (momentum buffers,
    Adam moments, ...) is broadcast in place of a tensor of the root's shape, and every
    scalar (``lr``, ``betas``, ``step``...) keeps its Python type.

    Args:
        optimizer: the optimizer (plain or ``DistributedOptimizer``).
        root_rank: the rank whose state everybody takes.
        model: where Horovod looks for sparse ``nn.Embedding`` modules, whose parameters
            get sparse zero gradients for ``SGD``.
        initialize_state: ``False`` skips the state-creating step (baguahvd only): no
            parameter moves and the root's state is never altered; only parameters without
            a gradient get a zero one, and the hyperparameters are broadcast even when
            nobody has state.

    Raises:
        ValueError: ``optimizer`` is a ``torch.optim.LBFGS``, whose state Horovod refuses to
            broadcast.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    # Before the state-creating step, which a stateless optimizer would take for nothing.
    runtime.require_engine()
    state = optimizer.state_dict()
    if not state["state"]:
        if initialize_state:
            _take_initializing_step(optimizer, model)
            state = optimizer.state_dict()
            if not state["state"]:
                return
        else:
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


def _take_initializing_step(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None
) -> None:
    """Horovod's way of creating an optimizer's state: a zero gradient on every parameter
    that requires one (replacing any gradient it had; see :func:`_zero_grads`), then one
    step of the optimizer's own class, which for a ``DistributedOptimizer`` skips its
    allreduces."""
    _zero_grads(optimizer, model, replace=True)
    own_class = getattr(optimizer, "_wrapped_optimizer_class", type(optimizer))
    own_class.step(optimizer)


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """The gradients Horovod's state-creating step leaves behind, without the step
    (``initialize_state=False``): a zero gradient where a parameter that requires one has
    none."""
    _zero_grads(optimizer, None, replace=False)


def _zero_grads(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, replace: bool
) -> None:
    """Zero gradients for the parameters that require one (only where they have none unless
    ``replace``): sparse for ``SparseAdam``, which takes only those, and for ``SGD`` on the
    weights of sparse embeddings of ``model``."""
    sparse_always = isinstance(optimizer, torch.optim.SparseAdam)
    sparse_weights: set[int] = set()
    if model is not None and isinstance(optimizer, torch.optim.SGD):
        sparse_weights = {
            id(module.weight) for module in model.modules()
            if isinstance(module, torch.nn.Embedding) and module.sparse
        }
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and (replace or p.grad is None):
                zeros = torch.zeros_like(p)
                p.grad = zeros.to_sparse() if sparse_always or id(p) in sparse_weights else zeros


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

