"""Allgather, grouped allgather and broadcast of CPU tensors: every dtype, ragged first
dimensions, the blocking/in-place/async variants, each root, and argument errors.

Every rank runs the same bodies; expected values are computed from ``rank`` and ``size``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import baguahvd.torch as hvd
from tests.support.tables import MOVABLE

BROADCAST_VARIANTS = ["broadcast", "broadcast_", "broadcast_async", "broadcast_async_"]


def values(rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s data: integers in [0, 100), exact in every dtype (uint8 included)."""
    count = math.prod(shape)
    return ((torch.arange(count) + 17 * rank + 5 * salt) % 100).reshape(tuple(shape)).to(dtype)


ROWS: dict[str, Callable[[int], int]] = {
    "rank_plus_one": lambda r: r + 1,
    "rank": lambda r: r,  # rank 0 sends no rows
    "three_minus_rank": lambda r: 3 - r,
}


# ---------------------------------------------------------------------------------------
# Allgather


@pytest.mark.parametrize("variant", ["allgather", "allgather_async"])
@pytest.mark.parametrize("tail", [(), (2, 3)], ids=str)
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("dtype", MOVABLE, ids=str)
def test_allgather(dtype: torch.dtype, rows: str, tail: tuple[int, ...], variant: str,
                   rank: int, size: int) -> None:
    def contribution(r: int) -> torch.Tensor:
        return values(r, (ROWS[rows](r), *tail), dtype)

    x = contribution(rank)
    before = x.clone()
    name = f"allgather.{variant}.{dtype}.{rows}.{tail}"
    if variant == "allgather":
        out = hvd.allgather(x, name=name)
    else:
        out = hvd.synchronize(hvd.allgather_async(x, name=name))
    expected = torch.cat([contribution(r) for r in range(size)])
    assert out.dtype == dtype
    assert out.shape == (sum(ROWS[rows](r) for r in range(size)), *tail)
    assert torch.equal(out, expected)
    assert torch.equal(x, before)


def test_allgather_unnamed_burst(rank: int, size: int) -> None:
    handles = [hvd.allgather_async(values(rank, (rank + 1, i + 1), torch.float32, salt=i))
               for i in range(12)]
    for i in reversed(range(len(handles))):
        expected = torch.cat([values(r, (r + 1, i + 1), torch.float32, salt=i)
                              for r in range(size)])
        assert torch.equal(hvd.synchronize(handles[i]), expected)


@pytest.mark.parametrize("variant", ["grouped_allgather", "grouped_allgather_async"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.int64, torch.float64],
                         ids=str)
def test_grouped_allgather(dtype: torch.dtype, variant: str, rank: int, size: int) -> None:
    shapes = [lambda r: (r + 1,), lambda r: (2, 4), lambda r: (r, 3, 2), lambda r: (1, 1)]
    tensors = [values(rank, shape(rank), dtype, salt=i) for i, shape in enumerate(shapes)]
    name = f"grouped_allgather.{variant}.{dtype}"
    if variant == "grouped_allgather":
        out = hvd.grouped_allgather(tensors, name=name)
    else:
        out = hvd.synchronize(hvd.grouped_allgather_async(tensors, name=name))
    assert isinstance(out, tuple)
    assert len(out) == len(shapes)
    for i, (shape, result) in enumerate(zip(shapes, out)):
        expected = torch.cat([values(r, shape(r), dtype, salt=i) for r in range(size)])
        assert result.dtype == dtype
        assert torch.equal(result, expected)


def test_allgather_same_name_with_changing_rows(rank: int, size: int) -> None:
    # Repeats hit the response cache; a rank whose first dimension changes invalidates it.
    for iteration in range(6):
        counts = [r + 1 for r in range(size)]
        if iteration in (2, 3):
            counts[size - 1] += 2  # only the last rank's request changes
        if iteration == 4:
            counts[0] = 0
        x = values(rank, (counts[rank], 2), torch.int32, salt=iteration)
        out = hvd.allgather(x, name="allgather.changing")
        expected = torch.cat([values(r, (counts[r], 2), torch.int32, salt=iteration)
                              for r in range(size)])
        assert torch.equal(out, expected)


def test_allgather_scalar_blocking_is_index_error() -> None:
    with pytest.raises(IndexError):
        hvd.allgather(torch.tensor(3.0))


def test_allgather_scalar_async_fails_on_every_rank(rank: int, size: int) -> None:
    handle = hvd.allgather_async(torch.tensor(float(rank)), name="allgather.scalar")
    with pytest.raises(hvd.HorovodInternalError, match="rank-zero tensor") as info:
        hvd.synchronize(handle)
    assert isinstance(info.value, RuntimeError)
    # The failed name is free again and the library still works.
    out = hvd.allgather(torch.tensor([float(rank)]), name="allgather.scalar")
    assert torch.equal(out, torch.arange(float(size)))


@pytest.mark.parametrize("variant", ["allgather", "allgather_async"])
@pytest.mark.parametrize("dtype, type_name",
                         [(torch.bool, "torch.BoolTensor"),
                          (torch.complex64, "torch.ComplexFloatTensor")],
                         ids=["bool", "complex64"])
def test_allgather_unsupported_dtype(dtype: torch.dtype, type_name: str, variant: str) -> None:
    call = hvd.allgather if variant == "allgather" else hvd.allgather_async
    with pytest.raises(ValueError, match=f"Tensor type {type_name} is not supported."):
        call(torch.zeros(2, dtype=dtype))


@pytest.mark.parametrize("variant", ["allgather", "allgather_async"])
def test_allgather_non_contiguous(variant: str) -> None:
    call = hvd.allgather if variant == "allgather" else hvd.allgather_async
    with pytest.raises(ValueError, match="Tensor is required to be contiguous."):
        call(torch.zeros(3, 4).t())


# ---------------------------------------------------------------------------------------
# Broadcast


def run_broadcast(variant: str, tensor: torch.Tensor, root: int, **kwargs: Any) -> Any:
    """Runs one broadcast variant and checks its object identity contract."""
    before = tensor.clone()
    if variant == "broadcast":
        out = hvd.broadcast(tensor, root, **kwargs)
    elif variant == "broadcast_":
        out = hvd.broadcast_(tensor, root, **kwargs)
    elif variant == "broadcast_async":
        out = hvd.synchronize(hvd.broadcast_async(tensor, root, **kwargs))
    else:
        out = hvd.synchronize(hvd.broadcast_async_(tensor, root, **kwargs))
    if variant.endswith("_"):
        assert out is tensor
    else:
        assert out is not tensor
        assert torch.equal(tensor, before), "out-of-place broadcast modified its input"
    return out


@pytest.mark.parametrize("variant", BROADCAST_VARIANTS)
@pytest.mark.parametrize("dtype", MOVABLE, ids=str)
def test_broadcast_every_root(dtype: torch.dtype, variant: str, rank: int, size: int) -> None:
    for root in range(size):
        x = values(rank, (2, 3, 4), dtype, salt=root)
        out = run_broadcast(variant, x, root, name=f"broadcast.{variant}.{dtype}.{root}")
        assert out.dtype == dtype
        assert torch.equal(out, values(root, (2, 3, 4), dtype, salt=root))


@pytest.mark.parametrize("variant", BROADCAST_VARIANTS)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (0,), (3, 0), (2, 1, 2, 1, 2)], ids=str)
def test_broadcast_shapes_unnamed(shape: tuple[int, ...], variant: str, rank: int,
                                  size: int) -> None:
    root = size - 1
    out = run_broadcast(variant, values(rank, shape, torch.float32), root)
    assert out.shape == shape
    assert torch.equal(out, values(root, shape, torch.float32))


def test_broadcast_async_burst_from_different_roots(rank: int, size: int) -> None:
    handles = []
    for i in range(30):
        handles.append(hvd.broadcast_async(values(rank, (i + 1,), torch.int64, salt=i), i % size,
                                           name=f"broadcast.burst.{i}"))
    for i in reversed(range(len(handles))):
        expected = values(i % size, (i + 1,), torch.int64, salt=i)
        assert torch.equal(hvd.synchronize(handles[i]), expected)


def test_broadcast_same_name_with_changing_root_and_shape(rank: int, size: int) -> None:
    for iteration in range(2 * size + 2):
        root = (iteration // 2) % size  # each root twice in a row: a cache hit, then a change
        shape = (3,) if iteration < 2 * size else (2, 2)
        out = hvd.broadcast(values(rank, shape, torch.float64, salt=iteration), root,
                            name="broadcast.changing")
        assert torch.equal(out, values(root, shape, torch.float64, salt=iteration))


@pytest.mark.parametrize("variant", BROADCAST_VARIANTS)
@pytest.mark.parametrize("root", ["size", "negative", "huge"])
def test_broadcast_invalid_root(root: str, variant: str, size: int) -> None:
    root_rank = {"size": size, "negative": -1, "huge": 1000}[root]
    with pytest.raises(ValueError, match=f"broadcast received invalid root rank {root_rank}"):
        run_broadcast(variant, torch.zeros(3), root_rank)


def test_broadcast_root_outside_process_set(rank: int, size: int) -> None:
    last = size - 1
    process_set = hvd.add_process_set([last])
    try:
        # Rank 0 is not in the set: an invalid root on the member, and either way a
        # ValueError on the other ranks, which are not members.
        with pytest.raises(ValueError) as info:
            hvd.broadcast(torch.zeros(2), 0, process_set=process_set)
        if rank == last:
            assert "broadcast received invalid root rank 0 for provided process set" in str(
                info.value
            )
        with pytest.raises(ValueError):
            hvd.broadcast_async_(torch.zeros(2), 0, process_set=process_set)
    finally:
        hvd.remove_process_set(process_set)


@pytest.mark.parametrize("variant", BROADCAST_VARIANTS)
def test_broadcast_unsupported_dtype_and_layout(variant: str) -> None:
    with pytest.raises(ValueError, match="Tensor type torch.BoolTensor is not supported."):
        run_broadcast(variant, torch.zeros(3, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="Tensor is required to be contiguous."):
        run_broadcast(variant, torch.zeros(3, 4).t(), 0)


def test_library_usable_after_errors(rank: int, size: int) -> None:
    out = hvd.broadcast(torch.full((2,), float(rank)), 0)
    assert torch.equal(out, torch.zeros(2))
    gathered = hvd.allgather(torch.full((1, 2), float(rank)))
    assert torch.equal(gathered[:, 0], torch.arange(float(size)))
