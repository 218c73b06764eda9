"""QAdam against its single-process simulation, through warmup and compression."""

from __future__ import annotations

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.torch.algorithms.optimizer import make_algorithm_optimizer
from baguahvd.torch.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
from tests.reference.qadam_sim import simulate_qadam

# Bit-exact in practice; the tolerance allows MPI to order float32 sums of three ranks
# differently than the simulation. The quantization noise is far larger (checked below).
TOLERANCE = dict(atol=2e-6, rtol=1e-5)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=generator)
    y = torch.randn(8, 3, generator=generator) + rank
    return torch.nn.functional.mse_loss(model(x), y)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
           steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        optimizer.step()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _assert_identical_across_ranks(tensor: torch.Tensor, name: str) -> None:
    gathered = hvd.allgather(tensor[None], name=name)
    for row in gathered:
        assert torch.equal(row, gathered[0])


@pytest.mark.parametrize("hierarchical", [False, True])
def test_qadam_optimizer_matches_the_simulation(rank: int, size: int, hierarchical: bool):
    warmup, steps, lr = 4, 9, 0.02
    model = _model()
    base = QAdamOptimizer(model.parameters(), lr=lr, warmup_steps=warmup, weight_decay=0.01)
    optimizer = make_algorithm_optimizer(
        base, model.named_parameters(), QAdamAlgorithm(base, hierarchical=hierarchical)
    )
    _train(model, optimizer, rank, steps)

    expected = simulate_qadam(_model(), _loss, size, steps, warmup, lr, weight_decay=0.01,
                              hierarchical=hierarchical)
    unquantized = simulate_qadam(_model(), _loss, size, steps, warmup, lr, weight_decay=0.01,
                                 hierarchical=hierarchical, quantize=False)
    got = _flat(model)
    torch.testing.assert_close(got, _flat(expected), **TOLERANCE)
    # The comparison is sharp enough to see the quantization.
    assert (got - _flat(unquantized)).abs().max() > 50 * TOLERANCE["atol"]
    _assert_identical_across_ranks(got, f"qadam.sim.{hierarchical}")
    state = optimizer.state_dict()["state"]
    assert set(state[0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(state[0]["step"]) == steps


def test_wrapped_adam_by_default_warmup(rank: int, size: int):
    # algorithm="qadam" around a torch.optim.Adam: Adam's settings, warmup of 100 steps.
    warmup, steps, lr = 100, 104, 0.01
    model = _model(1)
    optimizer = make_algorithm_optimizer(
        torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.99), weight_decay=0.1),
        model.named_parameters(), QAdamAlgorithm(hierarchical=False),
    )
    assert optimizer._impl is None or optimizer._impl.warmup_steps == warmup
    _train(model, optimizer, rank, steps)
    expected = simulate_qadam(_model(1), _loss, size, steps, warmup, lr, betas=(0.8, 0.99),
                              weight_decay=0.1)
    torch.testing.assert_close(_flat(model), _flat(expected), **TOLERANCE)
    _assert_identical_across_ranks(_flat(model), "qadam.adam.weights")

    # The state stays Adam's: a plain Adam continues from it.
    plain = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.99), weight_decay=0.1)
    plain.load_state_dict(optimizer.state_dict())
    _train(model, plain, rank, 1, first=steps)
    assert float(plain.state_dict()["state"][0]["step"]) == steps + 1


def test_switch_rebroadcasts_weights_and_state(rank: int, size: int):
    warmup = 3
    model = _model(2)
    base = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=warmup)
    optimizer = make_algorithm_optimizer(
        base, model.named_parameters(), QAdamAlgorithm(base, hierarchical=False)
    )
    _train(model, optimizer, rank, warmup - 1)
    # Drift that only the switch's broadcast from rank 0 removes.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * rank)
        for state in optimizer.state.values():
            state["exp_avg_sq"].add_(rank)
    _train(model, optimizer, rank, 1, first=warmup - 1)
    v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in optimizer.state.values()])
    _assert_identical_across_ranks(_flat(model), "qadam.switch.weights")
    _assert_identical_across_ranks(v, "qadam.switch.v")
    _train(model, optimizer, rank, 3, first=warmup)
    _assert_identical_across_ranks(_flat(model), "qadam.after.weights")
    v_after = torch.cat([s["exp_avg_sq"].reshape(-1) for s in optimizer.state.values()])
    assert torch.equal(v, v_after)  # frozen


def test_resumes_in_the_compression_stage_from_a_checkpoint(rank: int, size: int):
    warmup = 2
    model = _model(3)
    base = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=warmup)
    _train(model, base, rank=0, steps=warmup + 1)  # the same on every rank
    checkpoint = base.state_dict()
    restored = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=warmup)
    restored.load_state_dict(checkpoint)
    optimizer = make_algorithm_optimizer(
        restored, model.named_parameters(), QAdamAlgorithm(restored, hierarchical=False)
    )
    optimizer.load_state_dict(checkpoint)
    # Checkpoints are loaded after wrapping, as with Horovod; the stage follows the state.
    _train(model, optimizer, rank, 2, first=warmup + 1)
    if optimizer._impl is not None:
        assert optimizer._impl.compressing
    _assert_identical_across_ranks(_flat(model), "qadam.checkpoint.weights")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "torch.optim.Adam or a QAdamOptimizer"),
        (lambda ps: torch.optim.AdamW(ps), "decoupled_weight_decay|AdamW"),
        (lambda ps: torch.optim.Adam(ps, amsgrad=True), "amsgrad"),
        (lambda ps: torch.optim.Adam(ps, maximize=True), "maximize"),
    ],
)
def test_unsupported_optimizers_are_refused(size: int, make, match: str):
    model = _model()
    with pytest.raises(ValueError, match=match):
        make_algorithm_optimizer(make(model.parameters()), model.named_parameters(),
                                 QAdamAlgorithm())


def test_float64_parameters_are_refused(size: int):
    model = _model().double()
    with pytest.raises(ValueError, match="float64"):
        make_algorithm_optimizer(torch.optim.Adam(model.parameters()),
                                 model.named_parameters(), QAdamAlgorithm())
