"""More of ``baguahvd.torch`` with CUDA tensors, through the real engines of a two-rank job
on the stream model (``tests/fakes/gpu_job.py``): gradient accumulation, collectives called
directly, and one step of each Bagua algorithm that takes CUDA tensors.

What is checked is the stream order of every operation (a missing event or ``record_stream``
raises :class:`StreamViolation`), that the collectives ran on NCCL, and the arithmetic the
engine does around them. The fake NCCL moves no data: an allreduce leaves each buffer as
this rank sent it, so an average comes out as this rank's value over the two ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.algorithms import (
    ByteGradAlgorithm,
    DecentralizedAlgorithm,
    GradientAllReduceAlgorithm,
    QAdamAlgorithm,
    QAdamOptimizer,
)
from baguahvd.backends import nccl as backend
from baguahvd.torch.algorithms.base import Algorithm
from tests.fakes import gpu_job
from tests.fakes.stream_model import ModelStream, StreamModel
from tests.fakes.world import Job

pytestmark = pytest.mark.stream_model

GPU = 1
CUDA = f"cuda:{GPU}"


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    return gpu_job.engine_model(monkeypatch, GPU)


@pytest.fixture
def job(model: StreamModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    yield from gpu_job.training_job(monkeypatch)


def nccl_calls(model: StreamModel, name: str) -> int:
    """How many ``name`` calls rank 0's NCCL communicator made, its warm-up aside."""
    return sum(1 for call in model.fake.log.work(name) if call[1] == 0)


def network(model: StreamModel, stream: ModelStream) -> list[torch.Tensor]:
    with model.active(), model.use(stream):
        return [torch.full((3, 3), 0.1 * (i + 1), device=CUDA).requires_grad_()
                for i in range(3)]


def backward(model: StreamModel, weights: list[torch.Tensor], scale: float = 1.0) -> None:
    """One forward and backward pass on the current stream."""
    x = torch.ones(2, 3, device=CUDA).mul_(scale)
    for weight in weights:
        x = x.mm(weight)
    x.sum().backward()


def test_gradients_accumulated_over_two_passes_are_reduced_once(
    model: StreamModel, job: Job
) -> None:
    user = model.stream("user")
    weights = network(model, user)
    reference = [w.detach().clone() for w in weights]
    with model.active(), model.use(user):
        # The gradients of the two passes, computed without the optimizer.
        copies = [w.detach().clone().requires_grad_() for w in weights]
        backward(model, copies)
        backward(model, copies, scale=2.0)
        expected = [w.grad.clone() for w in copies]  # type: ignore[union-attr]
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(weights, lr=1.0),
            named_parameters=[(f"w{i}", w) for i, w in enumerate(weights)],
            backward_passes_per_step=2,
        )
        backward(model, weights)
        assert nccl_calls(model, "allReduce") == 0
        backward(model, weights, scale=2.0)
        optimizer.step()
        for weight, before, grad in zip(weights, reference, expected):
            # Averaged over two ranks (fake NCCL: this rank's sum), then one SGD step.
            assert torch.allclose(weight.detach(), before - grad / 2)
    assert 1 <= nccl_calls(model, "allReduce") <= len(weights)  # fused or not


def test_allgather_and_broadcast_of_cuda_tensors(model: StreamModel, job: Job) -> None:
    user = model.stream("user")
    with model.active(), model.use(user):
        tensor = torch.arange(6.0, device=CUDA).reshape(3, 2).add_(1)
        gathered = hvd.allgather(tensor, name="g")
        assert model.device_of(gathered) == GPU and gathered.shape == (6, 2)
        gathered.sum()  # read on the user's stream
        model.host_read(gathered)
        broadcast = hvd.broadcast(tensor, root_rank=0, name="b")
        assert torch.equal(broadcast, tensor)
        hvd.broadcast_(tensor, root_rank=0, name="b_")
        tensor.mul_(2)  # the user writes it again after the in-place broadcast
    assert nccl_calls(model, "allGather") == 1
    assert nccl_calls(model, "broadcast") == 2


@pytest.mark.parametrize(
    "algorithm", ["gradient_allreduce", "bytegrad", "decentralized", "qadam"]
)
def test_two_steps_of_a_bagua_algorithm_on_cuda_tensors(
    model: StreamModel, job: Job, algorithm: str
) -> None:
    # Flat: the hierarchical variants exchange host names over the job first, and the fake
    # NCCL moves no data.
    user = model.stream("user")
    weights = network(model, user)
    reference = [w.detach().clone() for w in weights]
    with model.active(), model.use(user):
        inner: torch.optim.Optimizer = torch.optim.SGD(weights, lr=0.1)
        flat: Algorithm
        if algorithm == "qadam":
            inner = QAdamOptimizer(weights, lr=0.1, warmup_steps=1)
            flat = QAdamAlgorithm(inner, hierarchical=False)
        elif algorithm == "gradient_allreduce":
            flat = GradientAllReduceAlgorithm(hierarchical=False)
        elif algorithm == "bytegrad":
            flat = ByteGradAlgorithm(hierarchical=False)
        else:
            flat = DecentralizedAlgorithm(hierarchical=False)
        optimizer = hvd.DistributedOptimizer(
            inner, named_parameters=[(f"w{i}", w) for i, w in enumerate(weights)],
            algorithm=flat,
        )
        for _ in range(2):
            optimizer.zero_grad()
            backward(model, weights)
            optimizer.step()
        for weight, before in zip(weights, reference):
            assert model.device_of(weight) == GPU
            # ByteGrad's chunks come back from the fake NCCL as they were sent: nothing to
            # say about its result.
            assert algorithm == "bytegrad" or not torch.equal(weight.detach(), before)
    nccl = sum(nccl_calls(model, name) for name in (
        "allReduce", "allGather", "broadcast", "send", "recv", "reduceScatter"
    ))
    assert nccl > 0
    assert isinstance(job.engines[0].process_sets[0].device_comm, backend.NCCLCommunicator)
