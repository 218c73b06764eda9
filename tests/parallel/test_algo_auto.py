"""algorithm="auto" on a real job: one choice everywhere, the cost model's choice, and the
chosen algorithm's results after the switch."""

from __future__ import annotations

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.algorithms import (
    AutoAlgorithm,
    ByteGradAlgorithm,
    GradientAllReduceAlgorithm,
    LinkFigures,
)
from baguahvd.torch.algorithms.optimizer import make_algorithm_optimizer

SLOW = LinkFigures(latency_s=1e-4, bandwidth=1e5)
FAST = LinkFigures(latency_s=1e-6, bandwidth=1e11)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)
    )


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
           first: int = 0) -> None:
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(100 * hvd.rank() + step)
        x, y = torch.randn(8, 12, generator=generator), torch.randn(8, 3, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _chosen(algorithm: object, steps: int = 3) -> str:
    model = _model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(), algorithm=algorithm,
    )
    _steps(model, optimizer, steps)
    choice = optimizer.algorithm_impl.choice
    optimizer.close()
    assert choice is not None
    return str(choice.name)


def test_every_rank_makes_the_same_choice(size: int) -> None:
    name = _chosen("auto")
    assert hvd.allgather_object(name) == [name] * size
    assert name in ("gradient_allreduce", "bytegrad")


@pytest.mark.parametrize(("link", "expected"), [(SLOW, "bytegrad"), (FAST, "gradient_allreduce")])
def test_injected_link_figures_decide(link: LinkFigures, expected: str) -> None:
    assert _chosen(AutoAlgorithm(link=link)) == expected


def test_after_the_switch_results_are_the_chosen_algorithms() -> None:
    model = _model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(), algorithm=AutoAlgorithm(link=SLOW),
    )
    _steps(model, optimizer, 5)
    optimizer.close()

    reference = _model()
    probing = make_algorithm_optimizer(
        torch.optim.SGD(reference.parameters(), lr=0.1), reference.named_parameters(),
        GradientAllReduceAlgorithm(),
    )
    _steps(reference, probing, 2)
    probing.close()
    chosen = make_algorithm_optimizer(
        torch.optim.SGD(reference.parameters(), lr=0.1), reference.named_parameters(),
        ByteGradAlgorithm(hierarchical=False),
    )
    _steps(reference, chosen, 3, first=2)
    chosen.close()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_weight_averaging_candidates_when_allowed_keep_one_choice(size: int) -> None:
    name = _chosen(AutoAlgorithm(allow_weight_averaging=True, probe_steps=1), steps=3)
    assert hvd.allgather_object(name) == [name] * size
