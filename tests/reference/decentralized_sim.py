"""Single-process simulations of N ranks running the decentralized algorithms.

Each simulated rank owns a model and an optimizer; a ``loss_fn(rank, step, model)`` gives
its loss. The simulations apply the algorithms' update rules directly to lists of flat
weights, with no buckets of replicas per rank: the low-precision one keeps a single public
model per ring member, which is what the replicas of a correct implementation must equal.
MinMaxUInt8 and the diff come from ``baguahvd.kernels``' torch functions (the oracle of the
compressor). Averages are computed like the engine's Average: a sum in rank order, then a
multiplication by 1/n.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from baguahvd.kernels import (
    compress_minmax_uint8,
    decompress_add_minmax_uint8_,
    lowprec_decentralized_diff_,
)

LossFn = Callable[[int, int, torch.nn.Module], torch.Tensor]


def shift_one_peer(rank: int, size: int, shift: int) -> int:
    """Peer rule of shift_one, written independently of the library."""
    half = size // 2
    if rank < half:
        return half + (rank + shift) % half
    return (rank - half - shift) % half


def mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total * (1.0 / len(tensors))


def partition(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket: reverse order, a bucket closes at >= bucket_bytes
    (single dtype)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in reversed(range(len(params))):
        current.append(index)
        size += params[index].numel() * params[index].element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _flat(model: torch.nn.Module, indices: Sequence[int]) -> torch.Tensor:
    params = list(model.parameters())
    return torch.cat([params[i].detach().reshape(-1) for i in indices])


def _write(model: torch.nn.Module, indices: Sequence[int], flat: torch.Tensor) -> None:
    params = list(model.parameters())
    offset = 0
    for i in indices:
        count = params[i].numel()
        params[i].data.copy_(flat[offset : offset + count].view_as(params[i]))
        offset += count


def _start_equal(models: Sequence[torch.nn.Module]) -> None:
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())


def _backward(models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
              loss_fn: LossFn, step: int) -> None:
    for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
        optimizer.zero_grad()
        loss_fn(rank, step, model).backward()


def _groups(nodes: Sequence[Sequence[int]] | None, size: int) -> list[list[int]]:
    # Without hierarchy every rank is a node of its own.
    return [list(node) for node in nodes] if nodes is not None else [[r] for r in range(size)]


def _node_means(
    flats: Sequence[torch.Tensor], nodes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    return [mean([flats[r] for r in node]) for node in nodes]


def simulate_decentralized(
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    loss_fn: LossFn,
    steps: int,
    mode: str = "all",
    interval: int = 1,
    nodes: Sequence[Sequence[int]] | None = None,
) -> None:
    """D-PSGD on ``len(models)`` simulated ranks; the models end with every rank's weights.

    Args:
        models: one model per rank; rank 0's weights are copied to the others first.
        optimizers: one optimizer per rank over its model's parameters.
        loss_fn: the loss of a rank at a step.
        steps: optimizer steps to run.
        mode: ``"all"`` or ``"shift_one"``.
        interval: communicate at steps 0, interval, 2*interval, ...
        nodes: hierarchical grouping of the ranks (node average, gossip among nodes, node
            broadcast); None for the flat (non-hierarchical) algorithm.
    """
    _start_equal(models)
    groups = _groups(nodes, len(models))
    everything = list(range(len(list(models[0].parameters()))))
    communications = 0
    for step in range(steps):
        communicate = step % interval == 0
        # The weights the forward pass uses are the ones that are mixed.
        snapshot = [_flat(model, everything) for model in models]
        _backward(models, optimizers, loss_fn, step)
        if communicate:
            node_weights = _node_means(snapshot, groups)
            count = len(groups)
            if count == 1:
                mixed = node_weights
            elif mode == "all":
                mixed = [mean(node_weights)] * count
            else:
                assert count % 2 == 0
                mixed = [
                    (node_weights[k] + node_weights[shift_one_peer(k, count, communications)]) / 2
                    for k in range(count)
                ]
            communications += 1
            for k, node in enumerate(groups):
                for r in node:
                    _write(models[r], everything, mixed[k])
        for optimizer in optimizers:
            optimizer.step()


def simulate_low_precision_decentralized(
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    loss_fn: LossFn,
    steps: int,
    interval: int = 1,
    nodes: Sequence[Sequence[int]] | None = None,
    bucket_bytes: int = 10 * 1024 * 1024,
) -> list[list[torch.Tensor]]:
    """Low-precision decentralized SGD on ``len(models)`` simulated ranks.

    Args: as :func:`simulate_decentralized`, plus ``bucket_bytes`` for the partition (one
    min/max per bucket).

    Returns:
        The public model of every ring member (node, or rank when ``nodes`` is None), per
        bucket: ``public[k][b]``. Ring member k's right neighbour's copy of its model, and its
        left neighbour's, must equal ``public[k][b]``.
    """
    _start_equal(models)
    groups = _groups(nodes, len(models))
    buckets = partition(list(models[0].parameters()), bucket_bytes)
    count = len(groups)
    public = [[_flat(models[0], b) for b in buckets] for _ in range(count)]
    for step in range(steps):
        _backward(models, optimizers, loss_fn, step)
        for optimizer in optimizers:
            optimizer.step()
        if step % interval:
            continue
        for b, indices in enumerate(buckets):
            node_weights = _node_means([_flat(m, indices) for m in models], groups)
            messages = []
            for k in range(count):
                d = node_weights[k].clone()
                left, right = public[(k - 1) % count][b], public[(k + 1) % count][b]
                lowprec_decentralized_diff_(d, public[k][b], left, right)
                messages.append(compress_minmax_uint8(d, 1))
            for k in range(count):
                decompress_add_minmax_uint8_(public[k][b], messages[k])
                for r in groups[k]:
                    _write(models[r], indices, public[k][b])
    return public
