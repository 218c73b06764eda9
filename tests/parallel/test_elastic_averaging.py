"""Weight-averaging algorithms keep a replica per rank: a commit, and
``hvd.averaged_state_dict``, hold the average over the ranks, the same on every rank."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch

import baguahvd.algorithms as hvd_algorithms
import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.elastic.store import CheckpointStore


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1)
    )


def _gathered_mean(tensor: torch.Tensor) -> torch.Tensor:
    every = hvd.allgather_object(tensor, name="test.gather")
    return torch.stack([t.to(torch.float64) for t in every]).mean(0)


def _same_on_every_rank(state: dict[str, torch.Tensor]) -> bool:
    every = hvd.allgather_object({k: v.clone() for k, v in state.items()}, name="test.every")
    return all(torch.equal(every[0][k], other[k]) for other in every for k in state)


def test_averaged_state_dict_is_the_mean_and_identical(rank: int, size: int) -> None:
    model = _model(rank)
    model(torch.randn(6, 4))  # BatchNorm statistics and counters differ per rank
    with torch.no_grad():
        model[1].num_batches_tracked.fill_(rank + 1)
    averaged = hvd.averaged_state_dict(model)
    assert _same_on_every_rank(averaged)
    for key, value in model.state_dict().items():
        if value.dtype.is_floating_point:
            expected = _gathered_mean(value).to(value.dtype)
            assert torch.allclose(averaged[key], expected, atol=1e-6), key
        else:
            assert averaged[key].item() == 1  # rank 0's counter
    # The model itself is left alone.
    assert torch.equal(model.state_dict()["0.weight"], _model(rank).state_dict()["0.weight"])


def test_an_optimizer_state_dict_averages_too(rank: int) -> None:
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    optimizer.step()
    averaged = hvd.averaged_state_dict(optimizer.state_dict())
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"]
    expected = _gathered_mean(momentum).float()
    assert torch.allclose(averaged["state"][0]["momentum_buffer"], expected, atol=1e-6)
    assert averaged["param_groups"] == optimizer.state_dict()["param_groups"]


@pytest.fixture
def elastic_dir() -> Iterator[str]:
    made = tempfile.mkdtemp(prefix="elastic-avg-") if hvd.rank() == 0 else None
    folder = hvd.broadcast_object(made, 0, name="elastic_dir")
    previous = runtime.config
    assert previous is not None
    runtime.config = dataclasses.replace(previous, elastic_dir=folder)
    try:
        yield folder
    finally:
        runtime.config = previous
        hvd.barrier()
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


_ALGORITHMS: dict[str, Callable[[], hvd_algorithms.Algorithm]] = {
    "decentralized": lambda: hvd_algorithms.DecentralizedAlgorithm(hierarchical=False),
    "low_precision_decentralized": lambda: hvd_algorithms.LowPrecisionDecentralizedAlgorithm(
        hierarchical=False
    ),
    "async": lambda: hvd_algorithms.AsyncModelAverageAlgorithm(
        sync_interval_ms=1, warmup_steps=0
    ),
}


@pytest.mark.parametrize("algorithm", sorted(_ALGORITHMS))
def test_a_commit_holds_the_average_of_the_replicas(
    rank: int, algorithm: str, elastic_dir: str
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        algorithm=_ALGORITHMS[algorithm](),
    )
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    state.sync()
    for step in range(4):
        generator = torch.Generator().manual_seed(100 * rank + step)
        optimizer.zero_grad()
        model(torch.randn(8, 4, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    impl = optimizer.algorithm_impl
    if algorithm == "async":
        # Stopping leaves the replicas averaged; local steps since then would differ.
        impl.abort()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (rank + 1))
    live = {k: v.clone() for k, v in model.state_dict().items()}
    assert not _same_on_every_rank(live)  # the replicas did differ
    state.commit()
    saved = state._handlers["model"].saved()
    assert _same_on_every_rank(saved)
    momentum = state._handlers["optimizer"].saved()["state"]
    assert _same_on_every_rank({str(k): v["momentum_buffer"] for k, v in momentum.items()})
    for key, value in live.items():
        assert torch.allclose(saved[key], _gathered_mean(value).float(), atol=1e-6), key
    # The live replicas go on untouched, and the file holds the same average.
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in live.items())
    state.wait_for_commit()  # the write runs in the background
    hvd.barrier()
    _, payload = CheckpointStore(elastic_dir, host="reader").load_newest()
    persisted = payload["handlers"]["model"]
    assert all(torch.equal(persisted[k], v) for k, v in saved.items())
    # After a restore every rank starts from the average.
    state.restore()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    if algorithm == "async":
        impl.abort()
