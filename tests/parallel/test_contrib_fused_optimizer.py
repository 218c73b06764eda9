"""fuse_optimizer(hvd.DistributedOptimizer(...)) on every rank, Horovod's path and Bagua's
algorithms.

Each rank trains on its own data. The fused job must keep every rank's parameters
identical, equal bit for bit to the same job unfused, and close to a single-process oracle
whose gradient is the mean of every rank's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import baguahvd.torch as hvd
from baguahvd.contrib import fuse_optimizer, is_fused_optimizer

MAKERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}
STEPS = 4


def mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3)).to(dtype)


def loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    dtype = next(model.parameters()).dtype
    x = torch.randn(6, 5, generator=g, dtype=dtype)
    y = torch.randn(6, 3, generator=g, dtype=dtype)
    return nn.functional.mse_loss(model(x), y)


def train(
    rank: int,
    make: Callable[[Any], torch.optim.Optimizer],
    fused: bool,
    algorithm: str | None = None,
) -> nn.Module:
    # The compressing algorithms take float32, float16 and bfloat16 only.
    model = mlp(torch.float64 if algorithm is None else torch.float32)
    optimizer = hvd.DistributedOptimizer(
        make(model.parameters()), named_parameters=model.named_parameters(), algorithm=algorithm
    )
    if fused:
        optimizer = fuse_optimizer(optimizer)
        assert is_fused_optimizer(optimizer)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        loss(model, rank, step).backward()
        optimizer.step()
    if fused:
        assert vars(optimizer)["_baguahvd_fusion"].fused_steps > 0
    close = getattr(optimizer, "close", None)
    if close is not None:
        close()
    return model


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_fused_distributed_optimizer(rank: int, size: int, name: str) -> None:
    make = MAKERS[name]
    fused = train(rank, make, fused=True)
    plain = train(rank, make, fused=False)
    ref = mlp()
    ref_optimizer = make(ref.parameters())
    for step in range(STEPS):
        ref_optimizer.zero_grad()
        for r in range(size):
            (loss(ref, r, step) / size).backward()
        ref_optimizer.step()
    for p, q, o in zip(fused.parameters(), plain.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        gathered = hvd.allgather(p.detach().reshape(1, -1))
        for other in gathered:
            assert torch.equal(other, p.detach().reshape(-1))
        torch.testing.assert_close(p, o, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad", "decentralized"])
def test_fused_with_bagua_algorithms(rank: int, size: int, algorithm: str) -> None:
    fused = train(rank, MAKERS["adam"], fused=True, algorithm=algorithm)
    plain = train(rank, MAKERS["adam"], fused=False, algorithm=algorithm)
    for p, q in zip(fused.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_fusing_before_wrapping_is_dropped_but_stays_correct(rank: int, size: int) -> None:
    # DistributedOptimizer builds a new optimizer from the param groups: the fusion is not
    # carried over, and training matches the unfused job.
    plain = train(rank, MAKERS["adam"], fused=False)
    model = mlp()
    optimizer = hvd.DistributedOptimizer(
        fuse_optimizer(MAKERS["adam"](model.parameters())),
        named_parameters=model.named_parameters(),
    )
    assert not is_fused_optimizer(optimizer)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        loss(model, rank, step).backward()
        optimizer.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)
