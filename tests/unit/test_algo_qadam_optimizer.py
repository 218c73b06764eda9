"""QAdamOptimizer on one process, and the algorithms' hyperparameter checks."""

from __future__ import annotations

import copy

import pytest
import torch

from baguahvd.torch.algorithms.async_model_average import AsyncModelAverageAlgorithm
from baguahvd.torch.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(16, 5, generator=generator)
        y = torch.randn(16, 2, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_equals_adam_while_warming_up(weight_decay: float):
    steps = 300
    model = _model()
    reference = copy.deepcopy(model)
    _run(model, QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=steps + 1,
                               weight_decay=weight_decay), steps)
    _run(reference, torch.optim.Adam(reference.parameters(), lr=1e-3,
                                     weight_decay=weight_decay), steps)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_state_dict_is_adams():
    model = _model()
    optimizer = QAdamOptimizer(model.parameters(), warmup_steps=2)
    _run(model, optimizer, 3)
    plain = torch.optim.Adam(model.parameters())
    plain.load_state_dict(optimizer.state_dict())
    _run(model, plain, 1)
    state = plain.state_dict()["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(state["step"]) == 4


def test_after_warmup_v_is_frozen_and_m_follows_the_raw_gradient():
    model = _model()
    optimizer = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2, weight_decay=0.5)
    _run(model, optimizer, 2)
    p = next(model.parameters())
    v = optimizer.state[p]["exp_avg_sq"].clone()
    m = optimizer.state[p]["exp_avg"].clone()
    before = p.detach().clone()
    optimizer.zero_grad()
    model(torch.ones(3, 5)).sum().backward()
    assert p.grad is not None
    expected_m = m.lerp(p.grad, 0.1)  # no weight decay after warmup
    optimizer.step()
    assert torch.equal(optimizer.state[p]["exp_avg_sq"], v)
    assert torch.equal(optimizer.state[p]["exp_avg"], expected_m)
    t = 3
    denom = (v.sqrt() / (1 - 0.999**t) ** 0.5).add_(1e-8)
    torch.testing.assert_close(p.detach(), before - 0.01 / (1 - 0.9**t) * expected_m / denom)


def test_closure_loss_is_returned():
    model = _model()
    optimizer = QAdamOptimizer(model.parameters())

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(torch.ones(2, 5)).sum()
        loss.backward()
        return loss

    assert isinstance(optimizer.step(closure), torch.Tensor)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"lr": -1.0}, "lr"),
        ({"eps": -1e-8}, "eps"),
        ({"betas": (1.0, 0.999)}, r"betas\[0\]"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
    ],
)
def test_bad_optimizer_hyperparameters_are_named(kwargs: dict, name: str):
    with pytest.raises(ValueError, match=name):
        QAdamOptimizer(_model().parameters(), **kwargs)


def test_qadam_algorithm_arguments():
    with pytest.raises(ValueError, match="q_adam_optimizer"):
        QAdamAlgorithm(torch.optim.Adam(_model().parameters()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hierarchical"):
        QAdamAlgorithm(hierarchical=1)  # type: ignore[arg-type]
    optimizer = QAdamOptimizer(_model().parameters(), warmup_steps=7)
    algorithm = QAdamAlgorithm(optimizer)
    assert algorithm.name == "qadam"
    assert algorithm.warmup_steps_for(optimizer) == 7
    assert QAdamAlgorithm().warmup_steps_for(optimizer) == 7
    assert QAdamAlgorithm().warmup_steps_for(torch.optim.Adam(_model().parameters())) == 100


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"peer_selection_mode": "shift_one"}, "peer_selection_mode"),
        ({"sync_interval_ms": 0}, "sync_interval_ms"),
        ({"sync_interval_ms": -5}, "sync_interval_ms"),
        ({"sync_interval_ms": float("inf")}, "sync_interval_ms"),
        ({"sync_interval_ms": "20"}, "sync_interval_ms"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
    ],
)
def test_bad_async_hyperparameters_are_named(kwargs: dict, name: str):
    with pytest.raises(ValueError, match=name):
        AsyncModelAverageAlgorithm(**kwargs)


def test_async_defaults():
    algorithm = AsyncModelAverageAlgorithm()
    assert algorithm.name == "async"
    assert (algorithm.peer_selection_mode, algorithm.sync_interval_ms,
            algorithm.warmup_steps) == ("all", 500, 0)
