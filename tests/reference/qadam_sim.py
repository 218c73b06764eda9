"""Single-process simulation of QAdam over N ranks: the weights every rank must end with.

Every rank holds the same weights and optimizer state (the algorithm keeps them identical),
so one model and one (m, v) stand for all ranks; only the gradients differ per rank. Written
from the spec (bagua_spec.md 1.6, with this project's full-Adam warmup):

* step t <= W: g = mean over ranks of the raw gradients (summed in rank order, then times
  1/n, as the engine averages); Adam with L2 weight decay on g;
* step t > W: m_r = lerp(m, g_r, 1 - b1) per rank with its raw gradient; the ranks' m_r,
  flattened in reverse parameter order and padded with zeros to a multiple of n, are
  averaged by ByteGrad's scatter-gather (the torch kernels are the quantizer oracle;
  ``hierarchical`` = one node: a full-precision mean, then both quantization rounds with one
  chunk); the update uses that m and the frozen v.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.reference.bytegrad_sim import simulate_bytegrad

LossFn = Callable[[torch.nn.Module, int, int], torch.Tensor]
"""(model, rank, step) -> that rank's loss at that step."""


def _rank_grads(model: torch.nn.Module, loss_fn: LossFn, rank: int, step: int) -> list[
    torch.Tensor
]:
    model.zero_grad()
    loss_fn(model, rank, step).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    return grads


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total += tensor
    return total.mul_(1.0 / len(tensors))


def average_moments(
    flats: list[torch.Tensor], hierarchical: bool, quantize: bool = True
) -> torch.Tensor:
    """What every rank holds after the compressed average of the ranks' padded buckets."""
    if not quantize:
        return _mean(flats)
    if hierarchical:
        return simulate_bytegrad([_mean(flats)])
    return simulate_bytegrad(flats)


@torch.no_grad()
def _flatten(tensors: list[torch.Tensor], n: int) -> torch.Tensor:
    numel = sum(t.numel() for t in tensors)
    flat = torch.zeros(-(-numel // n) * n, dtype=tensors[0].dtype)
    torch.cat([t.reshape(-1) for t in reversed(tensors)], out=flat[:numel])
    return flat


@torch.no_grad()
def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = [torch.empty(0)] * len(like)
    offset = 0
    for index in reversed(range(len(like))):
        count = like[index].numel()
        out[index] = flat[offset : offset + count].view_as(like[index]).clone()
        offset += count
    return out


def simulate_qadam(
    model: torch.nn.Module,
    loss_fn: LossFn,
    size: int,
    steps: int,
    warmup_steps: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    hierarchical: bool = False,
    quantize: bool = True,
) -> torch.nn.Module:
    """Trains ``model`` in place as ``size`` ranks running QAdam would; returns it.

    All parameters must fit one bucket (the default 10 MiB) and be float32.
    """
    beta1, beta2 = betas
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        t = float(step + 1)
        per_rank = [_rank_grads(model, loss_fn, r, step) for r in range(size)]
        with torch.no_grad():
            if t <= warmup_steps:
                for i, p in enumerate(params):
                    grad = _mean([grads[i] for grads in per_rank])
                    if weight_decay != 0:
                        grad = grad.add(p, alpha=weight_decay)
                    m[i].lerp_(grad, 1 - beta1)
                    v[i].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            else:
                flats = []
                for grads in per_rank:
                    mine = [mi.clone().lerp_(g, 1 - beta1) for mi, g in zip(m, grads)]
                    flats.append(_flatten(mine, size))
                m = _unflatten(average_moments(flats, hierarchical, quantize), m)
            for i, p in enumerate(params):
                step_size = lr / (1 - beta1**t)
                denom = (v[i].sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
                p.addcdiv_(m[i], denom, value=-step_size)
    return model
