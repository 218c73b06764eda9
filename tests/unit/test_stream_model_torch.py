"""The torch layer's own GPU code under the stream model: SyncBatchNorm, ByteGrad's
compressed exchange and the device check of async model averaging with CUDA tensors (one
rank; the collectives are replaced by what one rank of two would receive)."""

from __future__ import annotations

import types

import pytest
import torch

from baguahvd.torch import sync_batch_norm
from baguahvd.torch.algorithms import primitives
from baguahvd.torch.algorithms.async_model_average import AsyncModelAverageAlgorithm
from tests.fakes.stream_model import StreamModel, installed_model

pytestmark = pytest.mark.stream_model

GPU = 1
CUDA = f"cuda:{GPU}"


@pytest.fixture(params=[0, 1])
def model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    return installed_model(monkeypatch, GPU, request.param)


@pytest.mark.parametrize("batch", [4, 0], ids=["batch", "empty-batch"])
def test_sync_batch_norm_keeps_its_statistics_on_the_inputs_gpu(
    model: StreamModel, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    other_rank = torch.tensor([[6.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], dtype=torch.float64)

    def allgather(tensor: torch.Tensor, name: str) -> torch.Tensor:
        assert model.device_of(tensor) == GPU
        return torch.cat([tensor, other_rank.to(CUDA)])

    def allreduce_(tensor: torch.Tensor, name: str, op: object) -> torch.Tensor:
        assert model.device_of(tensor) == GPU
        return tensor

    monkeypatch.setattr(sync_batch_norm, "allgather", allgather)
    monkeypatch.setattr(sync_batch_norm, "allreduce_", allreduce_)
    with model.active():
        x = torch.randn(batch, 3, 2, device=CUDA).requires_grad_(batch > 0)
        weight = torch.ones(3, device=CUDA, requires_grad=True)
        bias = torch.zeros(3, device=CUDA, requires_grad=True)
        mean, var = torch.zeros(3, device=CUDA), torch.ones(3, device=CUDA)
        out = sync_batch_norm._SyncBatchNormFunction.apply(x, weight, bias, mean, var, 1e-5, 0.1)
        assert model.device_of(out) == GPU
        if batch:
            out.sum().backward()
            assert x.grad is not None and model.device_of(x.grad) == GPU


@pytest.mark.parametrize("numel", [5, 8])
def test_bytegrad_exchanges_compressed_chunks_from_the_gpu(
    model: StreamModel, monkeypatch: pytest.MonkeyPatch, numel: int
) -> None:
    exchanged: list[int] = []

    def alltoall(tensor: torch.Tensor, name: str, process_set: object) -> torch.Tensor:
        exchanged.append(model.device_of(tensor))
        return tensor.clone()

    def allgather(tensor: torch.Tensor, name: str, process_set: object) -> torch.Tensor:
        exchanged.append(model.device_of(tensor))
        return torch.cat([tensor, tensor])

    monkeypatch.setattr(primitives, "alltoall", alltoall)
    monkeypatch.setattr(primitives, "allgather", allgather)
    with model.active():
        flat = torch.linspace(-1, 1, numel, device=CUDA)
        primitives.compressed_average(flat, "b", None, 2, average=True)  # type: ignore[arg-type]
        assert model.device_of(flat) == GPU
    assert exchanged == [GPU, GPU]


def test_async_model_averaging_refuses_a_model_split_between_host_and_gpu(
    model: StreamModel
) -> None:
    with model.active():
        weight = torch.ones(4, device=CUDA)
        bias = model.mark_host(torch.ones(4))
    context = types.SimpleNamespace(parameters=[("fc.weight", weight), ("fc.bias", bias)])
    with pytest.raises(ValueError, match=r"fc\.weight on cuda:1, fc\.bias on the host"):
        AsyncModelAverageAlgorithm().reify(context)  # type: ignore[arg-type]
