"""Async model averaging: warmup, background averaging, abort/resume; on the CPU, and on
GPUs where the node has one per rank (skipped otherwise).

The toy problem pulls rank r's weights towards its own target ``r * OFFSET``; trained
alone, the ranks end one OFFSET apart, while averaging keeps them close together.
"""

from __future__ import annotations

import time

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.backends.mpi import MPICommunicator
from baguahvd.backends.nccl import NCCLCommunicator
from baguahvd.runtime import runtime
from baguahvd.torch.algorithms.async_model_average import AsyncModelAverageAlgorithm
from baguahvd.torch.algorithms.optimizer import make_algorithm_optimizer
from tests.support.gpus import rank_gpu

DIM = 16
OFFSET = 1.0
LR = 0.02


class _Vector(torch.nn.Module):
    def __init__(self, rank: int, device: torch.device | None = None) -> None:
        super().__init__()
        # Rank-dependent start: the switch to the async phase broadcasts rank 0's.
        self.w = torch.nn.Parameter(torch.full((DIM,), 0.1 * rank, device=device))


def _setup(rank: int, warmup_steps: int, device: torch.device | None = None) -> tuple[
    _Vector, torch.optim.Optimizer, AsyncModelAverageAlgorithm
]:
    model = _Vector(rank, device)
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=20, warmup_steps=warmup_steps)
    optimizer = make_algorithm_optimizer(
        torch.optim.SGD(model.parameters(), lr=LR), model.named_parameters(), algorithm
    )
    return model, optimizer, algorithm


def _step(model: _Vector, optimizer: torch.optim.Optimizer, rank: int) -> None:
    optimizer.zero_grad()
    target = torch.full((DIM,), rank * OFFSET, device=model.w.device)
    (0.5 * (model.w - target).pow(2).sum()).backward()
    optimizer.step()


def _train_for(seconds: float, model: _Vector, optimizer: torch.optim.Optimizer,
               rank: int, min_rounds: int = 0) -> None:
    """Trains for ``seconds``, and on until ``min_rounds`` averaging rounds have run (the
    machine may be oversubscribed)."""
    start = time.monotonic()
    impl = optimizer._impl
    while time.monotonic() - start < seconds or impl.rounds < min_rounds:
        assert time.monotonic() - start < 60, f"only {impl.rounds} rounds in 60 s"
        _step(model, optimizer, rank)
        time.sleep(0.002)


def _gathered(model: _Vector, name: str) -> torch.Tensor:
    return hvd.allgather(model.w.detach().clone()[None], name=name)


def test_warmup_averages_gradients_then_async_pulls_models_together(rank: int, size: int):
    _warmup_then_async(rank, size, None)


@pytest.mark.cuda
def test_cuda_weights_are_averaged_over_nccl(rank: int, size: int):
    _warmup_then_async(rank, size, rank_gpu())


def _warmup_then_async(rank: int, size: int, device: torch.device | None) -> None:
    model, optimizer, algorithm = _setup(rank, warmup_steps=5, device=device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    impl = optimizer._impl
    for _ in range(5):
        _step(model, optimizer, rank)
        assert not impl.running
    gathered = _gathered(model, "async.warmup")
    assert all(torch.equal(row, gathered[0]) for row in gathered)  # synchronous so far

    _train_for(1.5, model, optimizer, rank, min_rounds=5)
    assert impl.running
    algorithm.abort(optimizer)
    assert not impl.running

    # Stopped: nothing changes the weights any more.
    frozen = model.w.detach().clone()
    time.sleep(0.1)
    assert torch.equal(model.w.detach(), frozen)

    gathered = _gathered(model, "async.final")
    spread = (gathered - gathered.mean(0)).abs().max().item()
    # Alone, the ranks would be about (size - 1) * OFFSET apart.
    assert spread < 0.3 * OFFSET, spread
    averaged = hvd.allreduce(model.w.detach(), op=hvd.Average, name="async.average")
    assert averaged.min() > -0.25 * OFFSET and averaged.max() < (size - 1 + 0.25) * OFFSET
    if device is not None:
        assert isinstance(impl._device_comm, NCCLCommunicator)
        assert impl._device_comm.device == device  # made by the averaging thread
    optimizer.close()


def test_a_private_device_communicator_is_nccl_over_the_private_communicator(
    rank: int, size: int
):
    # What the averaging thread of CUDA weights runs on. Lazy: nothing needs a GPU yet.
    comm = runtime.new_communicator()
    assert comm is not None
    device_comm = runtime.new_device_communicator(comm)
    try:
        if isinstance(comm, MPICommunicator):
            assert isinstance(device_comm, NCCLCommunicator)
            assert device_comm.comm is comm.comm and device_comm.device is None
            assert (device_comm.rank, device_comm.size) == (rank, size)
        else:
            # CPU collectives on gloo: gloo moves CUDA tensors itself.
            assert device_comm is comm
    finally:
        comm.free()


def test_repeated_abort_and_resume(rank: int, size: int):
    model, optimizer, algorithm = _setup(rank, warmup_steps=0)
    impl = optimizer._impl
    # Before the first step nothing runs yet: both are no-ops.
    algorithm.abort(optimizer)
    algorithm.resume(optimizer)
    assert not impl.running

    _train_for(0.2, model, optimizer, rank, min_rounds=1)
    assert impl.running
    for _ in range(2):
        algorithm.abort(optimizer)
        algorithm.abort(optimizer)
        assert not impl.running
        rounds = impl.rounds
        _train_for(0.1, model, optimizer, rank)  # local training while stopped
        assert impl.rounds == rounds
        algorithm.resume(optimizer)
        algorithm.resume(optimizer)
        assert impl.running
        _train_for(0.3, model, optimizer, rank)
    algorithm.abort(optimizer)
    algorithm.resume(optimizer)
    algorithm.abort(optimizer)
    assert not impl.running and impl.rounds > 0
    frozen = model.w.detach().clone()
    time.sleep(0.05)
    assert torch.equal(model.w.detach(), frozen)
    optimizer.close()
    algorithm.abort(optimizer)  # after close: still a no-op


def test_first_async_step_starts_from_rank_zero_weights(rank: int, size: int):
    model, optimizer, algorithm = _setup(rank, warmup_steps=0)
    optimizer.zero_grad()
    model.w.grad = torch.zeros(DIM)  # a step that moves nothing
    optimizer.step()
    algorithm.abort(optimizer)
    gathered = _gathered(model, "async.switch")
    # Averaging rounds of identical models change nothing either.
    assert all(torch.allclose(row, torch.zeros(DIM), atol=1e-6) for row in gathered)
    optimizer.close()
