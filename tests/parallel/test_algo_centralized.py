"""gradient_allreduce and bytegrad against exact single-process oracles."""

from __future__ import annotations

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.algorithms import ByteGradAlgorithm, GradientAllReduceAlgorithm
from baguahvd.torch.algorithms.buckets import split_into_buckets
from baguahvd.torch.algorithms.optimizer import make_algorithm_optimizer
from tests.reference.bytegrad_sim import simulate_bytegrad


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 40),
        torch.nn.Tanh(),
        torch.nn.Linear(40, 40),
        torch.nn.Tanh(),
        torch.nn.Linear(40, 3),
    )


def _batch(rank: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, 12, generator=generator), torch.randn(rows, 3, generator=generator)


def _local_grads(model: torch.nn.Module, rank: int) -> list[torch.Tensor]:
    model.zero_grad()
    x, y = _batch(rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("hierarchical", [False, True])
def test_gradient_allreduce_matches_full_batch_sgd(rank: int, size: int, hierarchical: bool):
    model, reference = _model(), _model()
    optimizer = make_algorithm_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        GradientAllReduceAlgorithm(hierarchical=hierarchical),
    )
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(4):
        optimizer.zero_grad()
        x, y = _batch(rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        batches = [_batch(r) for r in range(size)]
        loss = sum(torch.nn.functional.mse_loss(reference(x), y) for x, y in batches) / size
        loss.backward()
        ref_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_gradient_allreduce_sum(rank: int, size: int):
    model = _model()
    optimizer = make_algorithm_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        GradientAllReduceAlgorithm(hierarchical=False, average=False),
    )
    expected = [sum(gs) for gs in zip(*(_local_grads(_model(), r) for r in range(size)))]
    x, y = _batch(rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.synchronize()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)
    optimizer.zero_grad()


def test_bytegrad_gradients_equal_the_simulation_bit_for_bit(rank: int, size: int):
    model = _model()
    optimizer = make_algorithm_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        ByteGradAlgorithm(hierarchical=False),
    )
    per_rank = [_local_grads(_model(), r) for r in range(size)]
    x, y = _batch(rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.synchronize()

    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    buckets = split_into_buckets(list(zip(names, params)), 10 * 1024 * 1024, alignment=size)
    index = {id(p): i for i, p in enumerate(params)}
    for bucket in buckets:
        flats = []
        for grads in per_rank:
            flat = torch.zeros_like(bucket.flat)
            torch.cat(
                [grads[index[id(p)]].reshape(-1) for p in bucket.params], out=flat[: bucket.numel]
            )
            flats.append(flat)
        expected = simulate_bytegrad(flats)
        got = torch.cat([p.grad.reshape(-1) for p in bucket.params])
        assert torch.equal(got, expected[: bucket.numel])
    optimizer.zero_grad()


def test_bytegrad_keeps_ranks_identical_and_close_to_exact(rank: int, size: int):
    model, reference = _model(), _model()
    optimizer = make_algorithm_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), "bytegrad"
    )
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for _ in range(5):
        optimizer.zero_grad()
        x, y = _batch(rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        batches = [_batch(r) for r in range(size)]
        (sum(torch.nn.functional.mse_loss(reference(x), y) for x, y in batches) / size).backward()
        ref_optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat[None], name="bytegrad.weights")
    assert all(torch.equal(gathered[0], row) for row in gathered)
    exact = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert (flat - exact).abs().max() < 5e-3


def test_unknown_algorithm_lists_the_known_ones():
    model = _model()
    with pytest.raises(ValueError, match="known algorithms: .*bytegrad"):
        make_algorithm_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "nope"
        )


def test_bad_hyperparameters_are_named():
    with pytest.raises(ValueError, match="hierarchical"):
        ByteGradAlgorithm(hierarchical="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="average"):
        GradientAllReduceAlgorithm(average=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad"])
def test_two_models_trained_by_one_loss(rank: int, size: int, algorithm: str) -> None:
    # Both optimizers' buckets are in flight at once; their names must not collide.
    first, second = _model(1), _model(2)
    optimizers = [
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
            algorithm=algorithm,
        )
        for tag, model in (("first", first), ("second", second))
    ]
    for step in range(3):
        x, y = _batch(rank + 10 * step)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(first(x), y) + second(x).pow(2).mean()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
    for index, model in enumerate((first, second)):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = hvd.allgather(flat.unsqueeze(0), name=f"two_models.check.{index}")
        assert all(torch.equal(gathered[0], row) for row in gathered)
