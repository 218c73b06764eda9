"""The collectives on CUDA tensors, through NCCL: every rank pins GPU ``local_rank`` as
Horovod's scripts do and checks results computed from ``rank`` and ``size``.

Skipped without a GPU, without CuPy's NCCL, or with fewer GPUs than ranks on the node (NCCL
refuses two ranks on one device). The tests are skipped one by one rather than the module at
once, so that the mpirun driver sees tests that ran or were skipped, never none.
"""

from __future__ import annotations

import math

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.common.exceptions import MismatchError
from baguahvd.common.ops import ReduceOp
from tests.support.gpus import rank_gpu
from tests.support.tables import MOVABLE, REDUCE_OPS, REDUCIBLE

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def device() -> torch.device:
    return rank_gpu()


def ramp(rank: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Small integers, exact in every dtype: rank r's data is (i + 3 r) % 7 + 1."""
    return ((torch.arange(count) + 3 * rank) % 7 + 1).to(dtype).to(device)


def all_ranks(size: int, count: int) -> torch.Tensor:
    """Every rank's ``ramp`` in float64, stacked by rank."""
    return torch.stack([ramp(r, count, torch.float64, torch.device("cpu")) for r in range(size)])


# ---------------------------------------------------------------------------------------
# Allreduce


@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
@pytest.mark.parametrize(
    "op", REDUCE_OPS, ids=[op.name.lower() for op in REDUCE_OPS],
)
def test_allreduce(rank: int, size: int, device: torch.device, dtype: torch.dtype,
                   op: ReduceOp) -> None:
    tensor = ramp(rank, 33, dtype, device)
    result = hvd.allreduce(tensor, op=op, name=f"cuda.allreduce.{dtype}.{op}")
    stacked = all_ranks(size, 33)
    expected = {
        hvd.Sum: stacked.sum(0),
        hvd.Average: stacked.sum(0) / size,
        hvd.Min: stacked.min(0).values,
        hvd.Max: stacked.max(0).values,
        hvd.Product: stacked.prod(0),
    }[op]
    if not dtype.is_floating_point:
        expected = torch.trunc(expected)
    assert result.device == device and result.dtype == dtype
    # An fp32 average over 3 ranks is rounded once (ncclAvg or a sum scaled by 1/3).
    tolerance = {torch.float16: 0.05, torch.bfloat16: 0.05, torch.float32: 1e-6}.get(
        dtype, 1e-9
    )
    torch.testing.assert_close(
        result.cpu().double(), expected, rtol=tolerance, atol=tolerance
    )


def test_in_place_async_and_scaled_allreduce(rank: int, size: int,
                                              device: torch.device) -> None:
    tensor = ramp(rank, 10, torch.float32, device)
    handle = hvd.allreduce_async_(
        tensor, op=hvd.Sum, name="cuda.inplace", prescale_factor=2.0, postscale_factor=0.5
    )
    output = hvd.synchronize(handle)
    assert output.data_ptr() == tensor.data_ptr()
    expected = all_ranks(size, 10).sum(0).float()
    torch.testing.assert_close(tensor.cpu(), expected)


def test_fused_grouped_allreduce(rank: int, size: int, device: torch.device) -> None:
    tensors = [ramp(rank, count, torch.float32, device) for count in (1, 7, 1000, 3)]
    results = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="cuda.grouped")
    for count, result in zip((1, 7, 1000, 3), results):
        assert result.device == device
        torch.testing.assert_close(result.cpu(), all_ranks(size, count)
                                   .sum(0).float())


def test_many_async_allreduces_fuse_and_complete(rank: int, size: int,
                                                 device: torch.device) -> None:
    tensors = [ramp(rank + i, 64, torch.float32, device) for i in range(40)]
    handles = [hvd.allreduce_async(t, op=hvd.Sum, name=f"cuda.burst.{i}")
               for i, t in enumerate(tensors)]
    for i, handle in enumerate(handles):
        expected = sum(ramp(r + i, 64, torch.float64, torch.device("cpu"))
                       for r in range(size))
        torch.testing.assert_close(hvd.synchronize(handle).cpu().double(), expected)


def test_allreduce_waits_for_work_queued_on_the_current_stream(rank: int, size: int,
                                                               device: torch.device) -> None:
    # The input is still being computed when the allreduce is submitted.
    big = torch.full((2048, 2048), 1.0 / 2048, device=device)
    tensor = (big @ big @ big).sum(0) * (rank + 1)
    result = hvd.allreduce(tensor, op=hvd.Sum, name="cuda.ordering")
    expected = torch.full((2048,), float(sum(r + 1 for r in range(size))))
    torch.testing.assert_close(result.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_adasum_on_gpu(rank: int, size: int, device: torch.device) -> None:
    if size & (size - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    tensor = torch.ones(8, device=device)
    result = hvd.allreduce(tensor, op=hvd.Adasum, name="cuda.adasum")
    # Identical vectors: Adasum returns the vector itself.
    torch.testing.assert_close(result.cpu(), torch.ones(8))


# ---------------------------------------------------------------------------------------
# Allgather, broadcast, alltoall, reducescatter


@pytest.mark.parametrize("dtype", MOVABLE, ids=str)
def test_allgather_of_uneven_rows(rank: int, size: int, device: torch.device,
                                  dtype: torch.dtype) -> None:
    tensor = ramp(rank, 3 * (rank + 1), dtype, device).reshape(rank + 1, 3)
    result = hvd.allgather(tensor, name=f"cuda.allgather.{dtype}")
    expected = torch.cat(
        [ramp(r, 3 * (r + 1), dtype, torch.device("cpu")).reshape(r + 1, 3) for r in range(size)]
    )
    assert result.device == device
    assert torch.equal(result.cpu(), expected)


def test_allgather_of_equal_rows(rank: int, size: int, device: torch.device) -> None:
    tensor = ramp(rank, 8, torch.float64, device).reshape(2, 4)
    result = hvd.allgather(tensor, name="cuda.allgather.equal")
    expected = torch.cat([ramp(r, 8, torch.float64, torch.device("cpu")).reshape(2, 4)
                          for r in range(size)])
    assert torch.equal(result.cpu(), expected)


@pytest.mark.parametrize("dtype", MOVABLE, ids=str)
def test_broadcast_from_every_root(rank: int, size: int, device: torch.device,
                                   dtype: torch.dtype) -> None:
    for root in range(size):
        tensor = ramp(rank, 17, dtype, device)
        result = hvd.broadcast(tensor, root, name=f"cuda.broadcast.{dtype}.{root}")
        assert torch.equal(result.cpu(), ramp(root, 17, dtype, torch.device("cpu")))
        hvd.broadcast_(tensor, root, name=f"cuda.broadcast_.{dtype}.{root}")
        assert torch.equal(tensor.cpu(), ramp(root, 17, dtype, torch.device("cpu")))


def test_alltoall_of_uneven_splits(rank: int, size: int, device: torch.device) -> None:
    def splits_of(r: int) -> list[int]:
        return [(r + j) % 3 for j in range(size)]

    def rows_of(r: int) -> torch.Tensor:
        count = sum(splits_of(r))
        return (torch.arange(count * 2) + 100 * r).reshape(count, 2).float()

    result, received = hvd.alltoall(rows_of(rank).to(device), splits=splits_of(rank),
                                    name="cuda.alltoall")
    pieces = []
    for r in range(size):
        start = sum(splits_of(r)[:rank])
        pieces.append(rows_of(r)[start:start + splits_of(r)[rank]])
    assert result.device == device
    assert torch.equal(result.cpu(), torch.cat(pieces))
    assert received.tolist() == [splits_of(r)[rank] for r in range(size)]


@pytest.mark.parametrize("rows", [6, 7], ids=["six_rows", "seven_rows"])
def test_reducescatter(rank: int, size: int, device: torch.device, rows: int) -> None:
    tensor = ramp(rank, rows * 2, torch.float32, device).reshape(rows, 2)
    result = hvd.reducescatter(tensor, op=hvd.Sum, name=f"cuda.reducescatter.{rows}")
    summed = all_ranks(size, rows * 2).sum(0).reshape(rows, 2)
    base, extra = divmod(rows, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(counts[:rank])
    assert result.device == device
    torch.testing.assert_close(result.cpu().double(), summed[start:start + counts[rank]])


# ---------------------------------------------------------------------------------------
# Process sets, join, mismatches, training


def test_allreduce_in_a_process_set(rank: int, size: int, device: torch.device) -> None:
    if size < 2:
        pytest.skip("a process set of two distinct ranks needs two")
    members = [0, size - 1]
    process_set = hvd.add_process_set(members)
    try:
        if rank in members:
            tensor = ramp(rank, 5, torch.float32, device)
            result = hvd.allreduce(tensor, op=hvd.Sum, name="cuda.subset",
                                   process_set=process_set)
            expected = sum(ramp(r, 5, torch.float32, torch.device("cpu")) for r in members)
            torch.testing.assert_close(result.cpu(), expected)
    finally:
        hvd.remove_process_set(process_set)


def test_a_joined_rank_contributes_zeros_on_its_gpu(rank: int, size: int,
                                                    device: torch.device) -> None:
    tensor = torch.ones(6, device=device)
    hvd.allreduce(tensor, name="cuda.join.warmup")
    if rank == 0:
        hvd.join(hvd.local_rank())
        return
    result = hvd.allreduce(tensor, op=hvd.Sum, name="cuda.join.sum")
    torch.testing.assert_close(result.cpu(), torch.full((6,), float(size - 1)))
    hvd.join(hvd.local_rank())


def test_cpu_and_gpu_tensors_under_one_name_are_a_mismatch(rank: int, size: int,
                                                           device: torch.device) -> None:
    if size < 2:
        pytest.skip("a mismatch between ranks needs two")
    tensor = torch.ones(3) if rank == 0 else torch.ones(3, device=device)
    with pytest.raises(MismatchError, match="CPU/GPU device selection"):
        hvd.allreduce(tensor, name="cuda.device_mismatch")


def test_barrier_and_cpu_collectives_still_work(rank: int, size: int,
                                                device: torch.device) -> None:
    hvd.allreduce(torch.ones(2, device=device), name="cuda.before_barrier")
    hvd.barrier()
    result = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="cuda.cpu_after")
    assert result.device.type == "cpu"
    torch.testing.assert_close(result, torch.full((2,), float(size)))


def test_distributed_optimizer_averages_gradients(rank: int, size: int,
                                                  device: torch.device) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False).to(device)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = model.weight.detach().clone()
    inputs = torch.full((1, 4), float(rank + 1), device=device)
    optimizer.zero_grad()
    model(inputs).sum().backward()
    optimizer.step()
    mean_input = sum(r + 1 for r in range(size)) / size
    expected = start - mean_input
    torch.testing.assert_close(model.weight.detach(), expected)
    assert not math.isnan(float(model.weight.sum()))
