"""Uneven data: ranks run out of batches at different steps, call ``join()``, and the job
neither hangs nor loses the ranks' gradients."""

from __future__ import annotations

import copy

import pytest
import torch

import baguahvd.torch as hvd


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(3, 4, generator=generator), torch.randn(3, 2, generator=generator)


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def test_training_on_uneven_batches_then_join(rank: int, size: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    steps = [2 + r for r in range(size)]  # rank r has r + 2 batches
    for step in range(steps[rank]):
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        optimizer.step()
    last = hvd.join()
    # The rank with the most batches joins last, and every rank says so.
    assert last == size - 1
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)

    # Joined ranks contribute zeros; Average still divides by the job's size.
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(max(steps)):
        total = [torch.zeros_like(p) for p in reference.parameters()]
        for r in range(size):
            if step < steps[r]:
                reference.zero_grad()
                _loss(reference, r, step).backward()
                total = [t + p.grad for t, p in zip(total, reference.parameters())]
        for p, t in zip(reference.parameters(), total):
            p.grad = t / size
        ref_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    # Everyone is back in step: a plain collective works.
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after_join").item() == size


def test_unnamed_collectives_stay_paired_after_a_join(rank: int, size: int) -> None:
    """A rank that joined early counts the unnamed collectives the others ran or failed
    meanwhile, so the next unnamed collectives of every rank pair up again (at any size)."""
    if rank == 0:
        last = hvd.join()
    else:
        # Runs without rank 0, which contributes zeros.
        total = hvd.allreduce(torch.ones(2), op=hvd.Sum)
        assert torch.equal(total, torch.full((2,), float(size - 1)))
        # Fails on every rank that submitted it: rank 0 has joined.
        with pytest.raises(hvd.HorovodInternalError, match="not supported with Join"):
            hvd.allgather(torch.ones(1, 3))
        last = hvd.join()
    # Ranks 1.. join at about the same time: any of them may be the last, the same on every
    # rank; rank 0 joined first.
    assert 0 < last < size
    summed = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum)
    assert summed.item() == sum(range(size))
    assert hvd.allgather(torch.tensor([rank])).tolist() == list(range(size))
    assert hvd.allgather_object(rank * 10) == [r * 10 for r in range(size)]
    assert hvd.allgather_object(last) == [last] * size
