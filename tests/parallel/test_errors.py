"""Deliberate cross-rank mismatches and bad arguments.

A mismatch must raise ``HorovodInternalError`` (a ``RuntimeError``) on every rank and leave the
library usable; a local argument error must raise on the calling rank only, before anything
is sent. Every test ends with a collective that must succeed, so a rank left out of step
shows up as a failure here rather than as a hang later.
"""

from __future__ import annotations

import pytest
import torch

import baguahvd.torch as hvd


def _still_works(size: int, name: str) -> None:
    """A collective that every rank runs after an error: it must give the right answer."""
    result = hvd.allreduce(torch.ones(4), op=hvd.Sum, name=f"after.{name}")
    assert torch.equal(result, torch.full((4,), float(size)))


def test_mismatch_error_is_a_runtime_error() -> None:
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_shape_mismatch_names_ranks_and_shapes(rank: int, size: int) -> None:
    tensor = torch.ones(rank + 3)
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(tensor, name="shape_mismatch")
    message = str(info.value)
    assert "Mismatched ALLREDUCE tensor shapes" in message
    assert "allreduce.shape_mismatch" in message
    assert "rank 0" in message and "[3]" in message
    assert "rank 1" in message and "[4]" in message
    _still_works(size, "shape")


def test_shape_mismatch_on_the_last_rank_only(rank: int, size: int) -> None:
    length = 7 if rank == size - 1 else 6
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(length), op=hvd.Sum, name="last_rank_differs")
    message = str(info.value)
    assert f"rank 0 sent a tensor of shape [6], but rank {size - 1} sent a tensor of shape [7]" \
        in message
    _still_works(size, "last_rank")


def test_shape_mismatch_multi_dim(rank: int, size: int) -> None:
    tensor = torch.ones(2, 3 + (rank % 2))
    with pytest.raises(hvd.HorovodInternalError, match=r"shape \[2, 3\].*shape \[2, 4\]"):
        hvd.allreduce_(tensor, name="shape_mismatch_2d")
    _still_works(size, "shape2d")


def test_unnamed_shape_mismatch(rank: int, size: int) -> None:
    with pytest.raises(hvd.HorovodInternalError, match="rank 0"):
        hvd.allreduce(torch.ones(rank + 1))
    # The unnamed slot counters stay aligned: the next unnamed collective matches.
    result = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    assert torch.equal(result, torch.full((2,), float(size)))


def test_dtype_mismatch(rank: int, size: int) -> None:
    dtype = torch.float32 if rank == 0 else torch.int32
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(5, dtype=dtype), name="dtype_mismatch")
    message = str(info.value)
    assert "Mismatched data types" in message
    assert "float32" in message and "int32" in message
    assert "rank 0" in message and "rank 1" in message
    _still_works(size, "dtype")


def test_dtype_mismatch_broadcast(rank: int, size: int) -> None:
    dtype = torch.float64 if rank == 0 else torch.float32
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched data types"):
        hvd.broadcast(torch.ones(3, dtype=dtype), root_rank=0, name="dtype_mismatch_bcast")
    _still_works(size, "dtype_bcast")


def test_reduce_op_mismatch(rank: int, size: int) -> None:
    op = hvd.Sum if rank == 0 else hvd.Average
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(3), op=op, name="op_mismatch")
    message = str(info.value)
    assert "Mismatched reduction operation" in message
    assert f"reduction op {int(hvd.Sum)}" in message
    assert f"reduction op {int(hvd.Average)}" in message
    _still_works(size, "op")


@pytest.mark.parametrize("which", ["prescale", "postscale"])
def test_scale_factor_mismatch(rank: int, size: int, which: str) -> None:
    factors = {which + "_factor": 1.0 + rank}
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(3), name=f"{which}_mismatch", **factors)
    message = str(info.value)
    assert "Mismatched prescale and/or postscale factors" in message
    expected_0 = "(1.0, 1.0)"
    expected_1 = "(2.0, 1.0)" if which == "prescale" else "(1.0, 2.0)"
    assert expected_0 in message and expected_1 in message
    _still_works(size, which)


def test_broadcast_root_mismatch(rank: int, size: int) -> None:
    root = 0 if rank == 0 else 1
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.broadcast(torch.ones(3), root_rank=root, name="root_mismatch")
    message = str(info.value)
    assert "Mismatched BROADCAST root ranks" in message
    assert "root rank 0" in message and "root rank 1" in message
    _still_works(size, "root")


def test_broadcast_shape_mismatch(rank: int, size: int) -> None:
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched BROADCAST tensor shapes"):
        hvd.broadcast_(torch.ones(rank + 1, 2), root_rank=0, name="bcast_shape_mismatch")
    _still_works(size, "bcast_shape")


def test_allgather_ndim_mismatch(rank: int, size: int) -> None:
    shape = (2, 3) if rank == 0 else (2, 3, 1)
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allgather(torch.ones(shape), name="ndim_mismatch")
    message = str(info.value)
    assert "Mismatched ALLGATHER tensor shapes" in message
    assert "tensor of rank 2" in message and "tensor of rank 3" in message
    _still_works(size, "ndim")


def test_allgather_non_first_dim_mismatch(rank: int, size: int) -> None:
    shape = (rank + 1, 3 if rank == 0 else 4)
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allgather(torch.ones(shape), name="dim_mismatch")
    message = str(info.value)
    assert "dimension 1 equal to 3" in message and "dimension 1 equal to 4" in message
    _still_works(size, "dim1")


def test_allgather_first_dim_may_differ(rank: int, size: int) -> None:
    gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="ragged_ok")
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])
    assert torch.equal(gathered, expected)


def test_alltoall_non_first_dim_mismatch(rank: int, size: int) -> None:
    tensor = torch.ones(size, 2 + (rank % 2))
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched ALLTOALL tensor shapes"):
        hvd.alltoall(tensor, name="alltoall_dim_mismatch")
    _still_works(size, "alltoall")


def test_reducescatter_shape_mismatch(rank: int, size: int) -> None:
    tensor = torch.ones(size * (1 + rank % 2), 2)
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched REDUCESCATTER tensor shapes"):
        hvd.reducescatter(tensor, name="rs_shape_mismatch")
    _still_works(size, "reducescatter")


def test_grouped_size_mismatch(rank: int, size: int) -> None:
    tensors = [torch.ones(2) for _ in range(1 + rank % 2)]
    with pytest.raises(hvd.HorovodInternalError, match="rank 0 sent 1 tensors"):
        hvd.grouped_allreduce(tensors, name="group_mismatch")
    _still_works(size, "grouped")


def test_different_collectives_in_one_unnamed_slot(rank: int, size: int) -> None:
    tensor = torch.ones(2, 2)
    with pytest.raises(hvd.HorovodInternalError) as info:
        if rank == 0:
            hvd.allreduce(tensor)
        else:
            hvd.allgather(tensor)
    message = str(info.value)
    assert "Mismatched operations" in message
    assert "ALLREDUCE" in message and "ALLGATHER" in message
    result = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    assert torch.equal(result, torch.full((2,), float(size)))


def test_mismatch_after_a_cached_success(rank: int, size: int) -> None:
    # The first rounds put the name in the response cache; the mismatch must still be caught.
    for _ in range(3):
        result = hvd.allreduce(torch.ones(4), op=hvd.Sum, name="cached_then_changed")
        assert torch.equal(result, torch.full((4,), float(size)))
    length = 5 if rank == size - 1 else 4
    with pytest.raises(hvd.HorovodInternalError, match=r"\[4\].*\[5\]"):
        hvd.allreduce(torch.ones(length), op=hvd.Sum, name="cached_then_changed")
    result = hvd.allreduce(torch.ones(4), op=hvd.Sum, name="cached_then_changed")
    assert torch.equal(result, torch.full((4,), float(size)))


def test_mismatch_async_raises_from_synchronize(rank: int, size: int) -> None:
    handle = hvd.allreduce_async(torch.ones(rank + 2), name="async_mismatch")
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched"):
        hvd.synchronize(handle)
    # The failed handle is consumed.
    assert hvd.synchronize(handle) is None
    _still_works(size, "async")


def test_poll_reports_a_failed_collective_as_done(rank: int, size: int) -> None:
    handle = hvd.allreduce_async(torch.ones(rank + 1), name="poll_failed")
    while not hvd.poll(handle):
        pass
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched"):
        hvd.synchronize(handle)
    _still_works(size, "poll_failed")


def test_duplicate_name_raises_on_offending_rank_only(rank: int, size: int) -> None:
    # Horovod's pattern: rank 0 queues "duplicate_name" twice before a barrier; the others
    # reach the barrier first and submit their single request after it.
    tensor = torch.full((3,), float(rank))
    if rank == 0:
        handle = hvd.allreduce_async(tensor, op=hvd.Sum, name="duplicate_name")
        with pytest.raises(ValueError) as info:
            hvd.allreduce_async(tensor, op=hvd.Sum, name="duplicate_name")
        assert "same name as another tensor that is currently being processed" in str(
            info.value
        )
        hvd.barrier()
    else:
        hvd.barrier()
        handle = hvd.allreduce_async(tensor, op=hvd.Sum, name="duplicate_name")
    result = hvd.synchronize(handle)
    assert torch.equal(result, torch.full((3,), float(sum(range(size)))))
    # Once completed, the name is free again.
    again = hvd.allreduce(tensor, op=hvd.Sum, name="duplicate_name")
    assert torch.equal(again, result)


def test_duplicate_name_other_collectives(rank: int, size: int) -> None:
    tensor = torch.ones(2)
    if rank == 0:
        handle = hvd.broadcast_async(tensor, root_rank=0, name="dup_bcast")
        with pytest.raises(ValueError, match="currently being processed"):
            hvd.broadcast_async_(tensor, root_rank=0, name="dup_bcast")
        hvd.barrier()
    else:
        hvd.barrier()
        handle = hvd.broadcast_async(tensor, root_rank=0, name="dup_bcast")
    assert torch.equal(hvd.synchronize(handle), tensor)
    _still_works(size, "dup_bcast")


@pytest.mark.parametrize(
    "call",
    [
        lambda x: hvd.allreduce(x),
        lambda x: hvd.allreduce_async(x),
        lambda x: hvd.allreduce_(x),
        lambda x: hvd.allgather(x),
        lambda x: hvd.broadcast(x, 0),
        lambda x: hvd.broadcast_(x, 0),
        lambda x: hvd.alltoall(x),
        lambda x: hvd.reducescatter(x),
        lambda x: hvd.grouped_allreduce([x]),
    ],
    ids=["allreduce", "allreduce_async", "allreduce_", "allgather", "broadcast",
         "broadcast_", "alltoall", "reducescatter", "grouped_allreduce"],
)
@pytest.mark.parametrize("value", [[1.0, 2.0], 3.0, "x"], ids=["list", "float", "str"])
def test_wrong_argument_type(size: int, call, value) -> None:
    with pytest.raises(TypeError):
        call(value)
    _still_works(size, "wrong_type")


def test_numpy_array_is_a_type_error(size: int) -> None:
    import numpy as np

    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allreduce_async(np.ones(3, dtype=np.float32))


@pytest.mark.parametrize(
    "call",
    [
        lambda x: hvd.allreduce(x),
        lambda x: hvd.allreduce_async_(x),
        lambda x: hvd.reducescatter(x),
    ],
    ids=["allreduce", "allreduce_async_", "reducescatter"],
)
@pytest.mark.parametrize(
    ("dtype", "type_name"),
    [
        (torch.bool, "torch.BoolTensor"),
        (torch.uint8, "torch.ByteTensor"),
        (torch.int8, "torch.CharTensor"),
        (torch.int16, "torch.ShortTensor"),
        (torch.complex64, "torch.ComplexFloatTensor"),
    ],
)
def test_unsupported_dtype_for_reductions(size: int, call, dtype, type_name) -> None:
    tensor = torch.zeros(size * 2, dtype=dtype)
    with pytest.raises(ValueError, match=f"Tensor type {type_name} is not supported."):
        call(tensor)
    _still_works(size, "dtype_reduce")


@pytest.mark.parametrize(
    "call",
    [
        lambda x: hvd.allgather(x),
        lambda x: hvd.broadcast(x, 0),
        lambda x: hvd.alltoall(x),
    ],
    ids=["allgather", "broadcast", "alltoall"],
)
@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_unsupported_dtype_for_data_movement(size: int, call, dtype) -> None:
    with pytest.raises(ValueError, match="is not supported."):
        call(torch.zeros(size, dtype=dtype))


def test_non_contiguous_tensor(size: int) -> None:
    tensor = torch.ones(4, 6).t()
    with pytest.raises(ValueError, match="Tensor is required to be contiguous."):
        hvd.allreduce_async_(tensor)
    _still_works(size, "contiguous")


def test_op_and_average_together(size: int) -> None:
    with pytest.raises(ValueError, match="The op parameter supersedes average."):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)


def test_unknown_reduce_op(size: int) -> None:
    with pytest.raises(ValueError, match="Unknown reduction op"):
        hvd.allreduce(torch.ones(2), op=17)
    _still_works(size, "unknown_op")


def test_broadcast_root_out_of_range(size: int) -> None:
    with pytest.raises(ValueError, match=f"invalid root rank {size}"):
        hvd.broadcast(torch.ones(2), root_rank=size)


def test_alltoall_argument_errors(size: int) -> None:
    with pytest.raises(ValueError, match="not an even multiple of the number of workers"):
        hvd.alltoall(torch.ones(size + 1))
    with pytest.raises(ValueError, match="greater than the first dimension"):
        hvd.alltoall(torch.ones(size), splits=[2] * size)
    with pytest.raises(ValueError, match="does not equal number of workers"):
        hvd.alltoall(torch.ones(size + 1), splits=[1] * (size + 1))
    with pytest.raises(ValueError, match="32-bit integer"):
        hvd.alltoall(torch.ones(size), splits=torch.ones(size, dtype=torch.int64))
    with pytest.raises(ValueError, match="1D splits"):
        hvd.alltoall(torch.ones(size), splits=torch.ones(1, size, dtype=torch.int32))
    _still_works(size, "alltoall_args")


def test_reducescatter_argument_errors(size: int) -> None:
    with pytest.raises(hvd.HorovodInternalError, match="only supports AVERAGE and SUM"):
        hvd.reducescatter(torch.ones(size), op=hvd.Max)
    with pytest.raises(ValueError, match="does not support scalar inputs"):
        hvd.reducescatter(torch.tensor(1.0))
    _still_works(size, "rs_args")


def test_allgather_scalar(size: int) -> None:
    with pytest.raises(IndexError):
        hvd.allgather(torch.tensor(1.0))
    with pytest.raises(hvd.HorovodInternalError, match="rank-zero tensor"):
        hvd.synchronize(hvd.allgather_async(torch.tensor(1.0), name="scalar_gather"))
    _still_works(size, "scalar")


def test_many_errors_in_a_row_then_success(rank: int, size: int) -> None:
    for step in range(5):
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce(torch.ones(rank + 1 + step), name=f"burst.{step}")
    handles = [
        hvd.allreduce_async(torch.full((3,), float(i)), op=hvd.Sum, name=f"burst_ok.{i}")
        for i in range(5)
    ]
    for i, handle in enumerate(handles):
        assert torch.equal(hvd.synchronize(handle), torch.full((3,), float(i * size)))


def test_sparse_tensor_is_pointed_to_the_sparse_path() -> None:
    sparse = torch.eye(3).to_sparse()
    for call in (
        lambda: hvd.allreduce(sparse, name="sparse.dense_path"),
        lambda: hvd.allgather(sparse, name="sparse.allgather"),
        lambda: hvd.broadcast(sparse, 0, name="sparse.broadcast"),
    ):
        with pytest.raises(ValueError, match="sparse_allreduce_async") as info:
            call()
        assert "contiguous" not in str(info.value)
    # The sparse path itself works.
    wait = hvd.sparse_allreduce_async(sparse, "sparse.ok", hvd.Sum)
    assert torch.equal(wait().to_dense(), torch.eye(3) * hvd.size())
