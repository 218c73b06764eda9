"""decentralized and low_precision_decentralized against single-process simulations."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.algorithms.decentralized import DecentralizedAlgorithm
from baguahvd.torch.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
from baguahvd.torch.algorithms.optimizer import make_algorithm_optimizer
from tests.reference.decentralized_sim import (
    simulate_decentralized,
    simulate_low_precision_decentralized,
)
from tests.support.tables import PEER_SELECTION_MODES

STEPS = 5


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 2),
    )


def _loss(rank: int, step: int, model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 10, generator=generator)
    y = torch.randn(8, 2, generator=generator)
    return torch.nn.functional.mse_loss(model(x), y)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _wrap(model: torch.nn.Module, algorithm: object) -> torch.optim.Optimizer:
    return make_algorithm_optimizer(_sgd(model), model.named_parameters(), algorithm)


def _train(optimizer: torch.optim.Optimizer, model: torch.nn.Module, rank: int) -> None:
    for step in range(STEPS):
        optimizer.zero_grad()
        _loss(rank, step, model).backward()
        optimizer.step()


def _nodes() -> list[list[int]]:
    hosts = hvd.allgather_object(socket.gethostname(), name="test.decentralized.hosts")
    by_host: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        by_host.setdefault(host, []).append(r)
    return sorted(by_host.values(), key=min)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _simulated_models(size: int) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    # Seeds differ per rank: the algorithm must broadcast rank 0's initial weights.
    models = [_model(seed=r) for r in range(size)]
    return models, [_sgd(m) for m in models]


@pytest.mark.parametrize("interval", [1, 2])
@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("mode", PEER_SELECTION_MODES)
def test_decentralized_matches_simulation(
    rank: int, size: int, mode: str, hierarchical: bool, interval: int
):
    nodes = _nodes()
    participants = len(nodes) if hierarchical else size
    model = _model(seed=rank)
    algorithm = DecentralizedAlgorithm(
        hierarchical=hierarchical, peer_selection_mode=mode, communication_interval=interval
    )
    if mode == "shift_one" and participants % 2:
        with pytest.raises(ValueError, match=rf"shift_one.*{participants}"):
            _wrap(model, algorithm)
        return
    optimizer = _wrap(model, algorithm)
    _train(optimizer, model, rank)

    models, optimizers = _simulated_models(size)
    simulate_decentralized(
        models, optimizers, _loss, STEPS, mode=mode, interval=interval,
        nodes=nodes if hierarchical else None,
    )
    torch.testing.assert_close(_flat(model), _flat(models[rank]), atol=1e-5, rtol=1e-5)
    optimizer.close()  # type: ignore[attr-defined]


def test_shift_one_on_a_single_node_needs_hierarchical_false(rank: int):
    if len(_nodes()) != 1:
        pytest.skip("runs on a single node")
    with pytest.raises(ValueError, match=r"1 nodes.*hierarchical=False"):
        _wrap(_model(rank), DecentralizedAlgorithm(peer_selection_mode="shift_one"))


@pytest.mark.parametrize("hierarchical", [False, True])
def test_all_mode_makes_ranks_identical_before_the_step(rank: int, hierarchical: bool):
    model = _model(seed=rank)
    optimizer = _wrap(model, DecentralizedAlgorithm(hierarchical=hierarchical))
    for step in range(3):
        optimizer.zero_grad()
        _loss(rank, step, model).backward()
        optimizer.synchronize()  # type: ignore[attr-defined]
        gathered = hvd.allgather(_flat(model)[None], name="test.decentralized.all")
        assert all(torch.equal(gathered[0], row) for row in gathered)
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            optimizer.step()
    gathered = hvd.allgather(_flat(model)[None], name="test.decentralized.all")
    # Local gradients make the models differ after the step.
    assert not all(torch.equal(gathered[0], row) for row in gathered)
    optimizer.close()  # type: ignore[attr-defined]


def test_gradients_are_not_communicated(rank: int):
    model = _model(seed=0)
    optimizer = _wrap(model, DecentralizedAlgorithm(hierarchical=False))
    _loss(rank, 0, model).backward()
    expected = [p.grad for p in model.parameters()]
    copies = [g.clone() for g in expected if g is not None]
    optimizer.synchronize()  # type: ignore[attr-defined]
    got = [p.grad for p in model.parameters()]
    assert len(copies) == len(got)
    for g, copy in zip(got, copies):
        assert g is not None and torch.equal(g, copy)
    with optimizer.skip_synchronize():  # type: ignore[attr-defined]
        optimizer.step()
    optimizer.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "hierarchical,interval,bucket_bytes",
    [(False, 1, None), (False, 2, None), (False, 1, 1000), (True, 1, None), (True, 2, 1000)],
)
def test_low_precision_matches_simulation(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch, hierarchical: bool, interval: int,
    bucket_bytes: int | None,
):
    if bucket_bytes is not None:
        assert runtime.config is not None
        monkeypatch.setattr(
            runtime, "config", dataclasses.replace(runtime.config, bucket_bytes=bucket_bytes)
        )
    nodes = _nodes()
    model = _model(seed=rank)
    algorithm = LowPrecisionDecentralizedAlgorithm(
        hierarchical=hierarchical, communication_interval=interval
    )
    optimizer = _wrap(model, algorithm)
    _train(optimizer, model, rank)

    models, optimizers = _simulated_models(size)
    simulate_low_precision_decentralized(
        models, optimizers, _loss, STEPS, interval=interval,
        nodes=nodes if hierarchical else None,
        bucket_bytes=bucket_bytes or 10 * 1024 * 1024,
    )
    if hierarchical and size > 2:
        # The node average is an MPI sum whose association may differ from the
        # simulation's rank order beyond two ranks, which can move a code by one step.
        torch.testing.assert_close(_flat(model), _flat(models[rank]), atol=1e-3, rtol=0)
    else:
        assert torch.equal(_flat(model), _flat(models[rank]))
    if hierarchical:
        gathered = hvd.allgather(_flat(model)[None], name="test.lowprec.hier")
        node = next(n for n in nodes if rank in n)
        assert all(torch.equal(gathered[node[0]], gathered[r]) for r in node)
    optimizer.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("bucket_bytes", [None, 1000])
def test_low_precision_replicas_stay_consistent(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch, bucket_bytes: int | None
):
    if bucket_bytes is not None:
        assert runtime.config is not None
        monkeypatch.setattr(
            runtime, "config", dataclasses.replace(runtime.config, bucket_bytes=bucket_bytes)
        )
    model = _model(seed=rank)
    optimizer = _wrap(model, LowPrecisionDecentralizedAlgorithm(hierarchical=False))
    _train(optimizer, model, rank)
    impl = optimizer._impl  # type: ignore[attr-defined]
    assert len(impl.replicas) == len(impl.buckets) >= (2 if bucket_bytes else 1)
    for b, replicas in enumerate(impl.replicas):
        # The model is the public replica.
        assert torch.equal(impl.buckets[b].gather_weights(torch.empty_like(replicas.weight)),
                           replicas.weight)
        stacked = torch.stack([replicas.weight, replicas.left, replicas.right])
        gathered = hvd.allgather(stacked[None], name=f"test.lowprec.replicas{b}")
        weight, left, right = gathered[:, 0], gathered[:, 1], gathered[:, 2]
        for r in range(size):
            assert torch.equal(left[r], weight[(r - 1) % size])
            assert torch.equal(right[r], weight[(r + 1) % size])
        # Gossip has moved the replicas away from each other and from the start.
        assert not torch.equal(weight[0], weight[1])
    optimizer.close()  # type: ignore[attr-defined]
