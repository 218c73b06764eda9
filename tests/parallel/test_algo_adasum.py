"""DistributedOptimizer(op=Adasum): Horovod's delta optimizer against a pure-torch oracle."""

from __future__ import annotations

import pytest
import torch

import baguahvd.torch as hvd


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)),
        torch.randn(8, 2, generator=torch.Generator().manual_seed(10 + rank)),
    )


def _deltas(weights: list[torch.Tensor], rank: int, lr: float) -> list[torch.Tensor]:
    model = torch.nn.Linear(4, 2)
    for p, w in zip(model.parameters(), weights):
        p.data.copy_(w)
    x, y = _data(rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [-lr * p.grad for p in model.parameters()]


def _adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a64, b64 = a.double(), b.double()
    dot = (a64 * b64).sum()
    return ((1 - dot / (2 * (a64 * a64).sum())) * a64
            + (1 - dot / (2 * (b64 * b64).sum())) * b64).to(a.dtype)


def test_adasum_optimizer_combines_updates(rank: int, size: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if size & (size - 1):
        with pytest.raises(NotImplementedError, match="power of 2"):
            hvd.DistributedOptimizer(optimizer, model.named_parameters(), op=hvd.Adasum)
        return
    optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters(), op=hvd.Adasum)
    for _ in range(3):
        start = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        x, y = _data(rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        level = [_deltas(start, r, 0.1) for r in range(size)]
        while len(level) > 1:
            level = [
                [_adasum_pair(a, b) for a, b in zip(level[i], level[i + 1])]
                for i in range(0, len(level), 2)
            ]
        for p, w, delta in zip(model.parameters(), start, level[0]):
            torch.testing.assert_close(p.detach(), w + delta, atol=1e-6, rtol=1e-5)


def test_adasum_optimizer_refuses_skip_synchronize(size: int) -> None:
    if size & (size - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    model = torch.nn.Linear(4, 2)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), op=hvd.Adasum
    )
    with pytest.raises(AssertionError, match="Skipping synchronization"):
        with optimizer.skip_synchronize():
            pass
