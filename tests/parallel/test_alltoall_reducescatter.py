"""Alltoall (equal and uneven splits, list and int32-tensor splits) and (grouped)
reducescatter of CPU tensors: dtypes, return types, scale factors, variants and errors.

Every rank runs the same bodies; expected values are computed from ``rank`` and ``size``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import baguahvd.torch as hvd
from tests.support.tables import MOVABLE, REDUCIBLE

HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------
# Alltoall


def values(rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s data: integers in [0, 100), exact in every dtype (uint8 included)."""
    count = math.prod(shape)
    return ((torch.arange(count) + 17 * rank + 5 * salt) % 100).reshape(tuple(shape)).to(dtype)


def plan(kind: str, r: int, size: int) -> tuple[int, list[int] | None]:
    """(rows of dim 0, splits) that rank ``r`` sends under the plan ``kind``."""
    if kind == "equal":
        return 2 * size, None
    if kind == "equal_explicit":
        return 2 * size, [2] * size
    if kind == "zero_rows_on_rank0":
        if r == 0:
            return 0, [0] * size
        return sum(j + 1 for j in range(size)), [j + 1 for j in range(size)]
    # Uneven, with zero splits and (for r > 0) an unsent tail of r rows.
    splits = [(r + j) % 3 for j in range(size)]
    return sum(splits) + r, splits


def expected_alltoall(kind: str, me: int, size: int, tail: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    pieces, received = [], []
    for r in range(size):
        rows, splits = plan(kind, r, size)
        splits = splits or [rows // size] * size
        offset = sum(splits[:me])
        pieces.append(values(r, (rows, *tail), dtype)[offset : offset + splits[me]])
        received.append(splits[me])
    return torch.cat(pieces), received


PLANS = ["equal", "equal_explicit", "uneven_list", "uneven_tensor", "zero_rows_on_rank0"]


@pytest.mark.parametrize("variant", ["alltoall", "alltoall_async"])
@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("dtype", MOVABLE, ids=str)
def test_alltoall(dtype: torch.dtype, kind: str, variant: str, rank: int, size: int) -> None:
    tail = (2, 3)
    rows, splits = plan(kind, rank, size)
    x = values(rank, (rows, *tail), dtype)
    before = x.clone()
    argument: Any = splits
    if kind == "uneven_tensor":
        argument = torch.tensor(splits, dtype=torch.int32)
    name = f"alltoall.{variant}.{kind}.{dtype}"
    if variant == "alltoall":
        result = hvd.alltoall(x, argument, name=name)
        if splits is None:
            assert isinstance(result, torch.Tensor)
            out, received = result, None
        else:
            assert isinstance(result, tuple) and len(result) == 2
            out, received = result
    else:
        result = hvd.synchronize(hvd.alltoall_async(x, argument, name=name))
        assert isinstance(result, tuple) and len(result) == 2  # always a pair
        out, received = result
    expected, expected_splits = expected_alltoall(kind, rank, size, tail, dtype)
    assert out.dtype == dtype
    assert torch.equal(out, expected)
    assert torch.equal(x, before)
    if received is not None:
        assert isinstance(received, torch.Tensor)
        assert received.dtype == torch.int32
        assert received.device.type == "cpu"
        assert received.tolist() == expected_splits


def test_alltoall_one_dimensional_unnamed(rank: int, size: int) -> None:
    x = torch.arange(size * 3, dtype=torch.int64) + 100 * rank
    out = hvd.alltoall(x)
    expected = torch.cat([torch.arange(3 * rank, 3 * rank + 3) + 100 * r for r in range(size)])
    assert torch.equal(out, expected)


def test_alltoall_async_burst_in_rank_dependent_order(rank: int, size: int) -> None:
    names = list(range(20))
    order = names[::-1] if rank % 2 else names
    handles = {}
    for i in order:
        kind = PLANS[i % len(PLANS)]
        rows, splits = plan(kind, rank, size)
        handles[i] = hvd.alltoall_async(values(rank, (rows, 2), torch.float32), splits,
                                        name=f"alltoall.burst.{i}")
    for i in names:
        kind = PLANS[i % len(PLANS)]
        out, received = hvd.synchronize(handles[i])
        expected, expected_splits = expected_alltoall(kind, rank, size, (2,), torch.float32)
        assert torch.equal(out, expected)
        assert received.tolist() == expected_splits


def test_alltoall_same_name_with_changing_splits(rank: int, size: int) -> None:
    # Repeats hit the response cache; a rank whose splits change invalidates it.
    for iteration in range(5):
        kind = "uneven" if iteration in (2, 3) else "equal_explicit"
        plans = [plan(kind, r, size) for r in range(size)]
        if iteration == 4:
            plans[0] = (size, [1] * size)  # only rank 0 changes
        rows, splits = plans[rank]
        x = values(rank, (rows, 2), torch.int16, salt=iteration)
        out, received = hvd.alltoall(x, splits, name="alltoall.changing")
        pieces = []
        for r, (rows_r, splits_r) in enumerate(plans):
            offset = sum(splits_r[:rank])
            sent = values(r, (rows_r, 2), torch.int16, salt=iteration)
            pieces.append(sent[offset : offset + splits_r[rank]])
        assert torch.equal(out, torch.cat(pieces))
        assert received.tolist() == [splits_r[rank] for _, splits_r in plans]


@pytest.mark.parametrize("variant", ["alltoall", "alltoall_async"])
def test_alltoall_scalar_fails_on_every_rank(variant: str) -> None:
    call = hvd.alltoall if variant == "alltoall" else hvd.alltoall_async
    with pytest.raises(hvd.HorovodInternalError):
        hvd.synchronize(call(torch.tensor(1.0), name=f"alltoall.scalar.{variant}"))


def _bad_splits(case: str, size: int) -> tuple[torch.Tensor, Any, str]:
    if case == "not_divisible":
        return torch.zeros(2 * size + 1, 2), None, (
            "splits not provided, but first dimension of tensor is not an even multiple of "
            "the number of workers."
        )
    if case == "wrong_length":
        return torch.zeros(2 * size, 2), [1] * (size + 1), (
            "Number of entries in splits does not equal number of workers."
        )
    if case == "sum_too_big":
        return torch.zeros(size, 2), [2] * size, (
            "Sum of splits entries is greater than the first dimension of tensor."
        )
    if case == "int64_tensor":
        return torch.zeros(size, 2), torch.ones(size, dtype=torch.int64), (
            "alltoall expects splits to contain 32-bit integer elements."
        )
    if case == "float_tensor":
        return torch.zeros(size, 2), torch.ones(size, dtype=torch.float32), (
            "alltoall expects splits to contain 32-bit integer elements."
        )
    return torch.zeros(size, 2), torch.ones(1, size, dtype=torch.int32), (
        "alltoall expects a 1D splits tensor"
    )


@pytest.mark.parametrize("variant", ["alltoall", "alltoall_async"])
@pytest.mark.parametrize(
    "case",
    ["not_divisible", "wrong_length", "sum_too_big", "int64_tensor", "float_tensor", "two_d"],
)
def test_alltoall_bad_splits(case: str, variant: str, size: int) -> None:
    tensor, splits, message = _bad_splits(case, size)
    call = hvd.alltoall if variant == "alltoall" else hvd.alltoall_async
    with pytest.raises(ValueError, match=re.escape(message)):
        call(tensor, splits)


@pytest.mark.parametrize("variant", ["alltoall", "alltoall_async"])
def test_alltoall_unsupported_dtype_and_layout(variant: str, size: int) -> None:
    call = hvd.alltoall if variant == "alltoall" else hvd.alltoall_async
    with pytest.raises(ValueError, match="Tensor type torch.BoolTensor is not supported."):
        call(torch.zeros(size, dtype=torch.bool))
    with pytest.raises(ValueError, match="Tensor is required to be contiguous."):
        call(torch.zeros(3, size).t())


# ---------------------------------------------------------------------------------------
# Reducescatter


def contribution(
    rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0
) -> torch.Tensor:
    """Small signed integers in [-3, 3], exact in every dtype, different on every rank."""
    count = math.prod(shape)
    return ((torch.arange(count) * 3 + 7 * rank + salt) % 7 - 3).reshape(tuple(shape)).to(dtype)


def scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's scaling arithmetic: integers in float64 truncated toward zero, half types in
    float32 rounded once."""
    if not tensor.is_floating_point():
        return torch.trunc(tensor.double() * factor).to(tensor.dtype)
    if tensor.dtype in HALF:
        return (tensor.float() * factor).to(tensor.dtype)
    return tensor * factor


def expected_reducescatter(
    me: int, size: int, shape: Sequence[int], dtype: torch.dtype, op: int,
    pre: float = 1.0, post: float = 1.0, salt: int = 0,
) -> torch.Tensor:
    inputs = [scaled(contribution(r, shape, dtype, salt), pre) for r in range(size)]
    total = torch.stack([t.double() for t in inputs]).sum(0).to(dtype)
    if op == hvd.Average:
        if pre == 1.0 and post == 1.0 and not dtype.is_floating_point:
            total = torch.div(total, size, rounding_mode="trunc")
        else:
            total = scaled(total, post / size)
    elif post != 1.0:
        total = scaled(total, post)
    rows = shape[0]
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    return total[sum(counts[:me]) : sum(counts[: me + 1])]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if expected.is_floating_point():
        torch.testing.assert_close(actual, expected)
    else:
        assert torch.equal(actual, expected), f"{actual} != {expected}"


def run_reducescatter(variant: str, tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    before = tensor.clone()
    if variant == "reducescatter":
        out = hvd.reducescatter(tensor, **kwargs)
    elif variant == "reducescatter_async":
        out = hvd.synchronize(hvd.reducescatter_async(tensor, **kwargs))
    elif variant == "grouped_reducescatter":
        group = hvd.grouped_reducescatter([tensor], **kwargs)
        assert isinstance(group, list) and len(group) == 1
        out = group[0]
    else:
        group = hvd.synchronize(hvd.grouped_reducescatter_async([tensor], **kwargs))
        assert isinstance(group, tuple) and len(group) == 1
        out = group[0]
    assert torch.equal(tensor, before)
    return out


RS_VARIANTS = [
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
]
# First dimensions: divisible, one extra row (rank 0 gets it), fewer rows than ranks, none.
RS_SHAPES = {"divisible": (6, 2), "extra_rows": (7, 3), "one_row": (1, 4), "empty": (0, 2)}


@pytest.mark.parametrize("variant", ["reducescatter", "grouped_reducescatter_async"])
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
@pytest.mark.parametrize("shape_name", list(RS_SHAPES))
@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
def test_reducescatter(dtype: torch.dtype, shape_name: str, op_name: str, variant: str,
                       rank: int, size: int) -> None:
    op = hvd.Sum if op_name == "Sum" else hvd.Average
    shape = RS_SHAPES[shape_name]
    if shape_name == "divisible":
        shape = (2 * size, 2)
    x = contribution(rank, shape, dtype)
    out = run_reducescatter(variant, x, op=op,
                            name=f"rs.{variant}.{dtype}.{shape_name}.{op_name}")
    assert_matches(out, expected_reducescatter(rank, size, shape, dtype, op))


def test_reducescatter_lower_ranks_get_extra_rows(rank: int, size: int) -> None:
    rows = 2 * size + size - 1  # every rank but the last gets one extra row
    out = hvd.reducescatter(torch.ones(rows, 2), op=hvd.Sum)
    assert out.shape == (3 if rank < size - 1 else 2, 2)
    assert torch.equal(out, torch.full_like(out, float(size)))


def test_reducescatter_default_op_is_average(rank: int, size: int) -> None:
    x = contribution(rank, (size, 5), torch.float64)
    out = hvd.reducescatter(x, name="rs.default")
    assert_matches(out, expected_reducescatter(rank, size, (size, 5), torch.float64,
                                               hvd.Average))


@pytest.mark.parametrize("factors", [(0.5, 3.0), (3.0, 0.5)], ids=str)
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
@pytest.mark.parametrize("variant", ["reducescatter_async", "grouped_reducescatter"])
@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
def test_reducescatter_prescale_postscale(dtype: torch.dtype, variant: str, op_name: str,
                                          factors: tuple[float, float], rank: int,
                                          size: int) -> None:
    pre, post = factors
    op = hvd.Sum if op_name == "Sum" else hvd.Average
    shape = (size + 1, 3)
    x = contribution(rank, shape, dtype)
    out = run_reducescatter(variant, x, op=op, prescale_factor=pre, postscale_factor=post,
                            name=f"rs.scale.{variant}.{dtype}.{op_name}.{pre}.{post}")
    assert_matches(out, expected_reducescatter(rank, size, shape, dtype, op, pre, post))


@pytest.mark.parametrize("variant", ["grouped_reducescatter", "grouped_reducescatter_async"])
def test_grouped_reducescatter_several_tensors(variant: str, rank: int, size: int) -> None:
    shapes = [(size, 2), (2 * size + 1,), (1, 2, 2), (3 * size - 1, 1)]
    tensors = [contribution(rank, s, torch.float32, salt=i) for i, s in enumerate(shapes)]
    if variant == "grouped_reducescatter":
        out = hvd.grouped_reducescatter(tensors, op=hvd.Sum, name="rs.grouped.many")
        assert isinstance(out, list)
    else:
        out = hvd.synchronize(hvd.grouped_reducescatter_async(tensors, op=hvd.Sum,
                                                              name="rs.grouped.many.async"))
        assert isinstance(out, tuple)
    for i, (shape, result) in enumerate(zip(shapes, out)):
        assert_matches(result, expected_reducescatter(rank, size, shape, torch.float32,
                                                      hvd.Sum, salt=i))


def test_reducescatter_async_burst(rank: int, size: int) -> None:
    handles = [hvd.reducescatter_async(contribution(rank, (i + 1, 2), torch.int32, salt=i),
                                       op=hvd.Sum) for i in range(15)]
    for i in reversed(range(len(handles))):
        expected = expected_reducescatter(rank, size, (i + 1, 2), torch.int32, hvd.Sum, salt=i)
        assert_matches(hvd.synchronize(handles[i]), expected)


def test_reducescatter_same_name_with_changing_shape(rank: int, size: int) -> None:
    for iteration, rows in enumerate([size, size, 2 * size + 1, 2 * size + 1, 1]):
        x = contribution(rank, (rows, 2), torch.int64, salt=iteration)
        out = hvd.reducescatter(x, op=hvd.Sum, name="rs.changing")
        assert_matches(out, expected_reducescatter(rank, size, (rows, 2), torch.int64, hvd.Sum,
                                                   salt=iteration))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_reducescatter_fp16_compression(dtype: torch.dtype, rank: int, size: int) -> None:
    shape = (size + 1, 3)
    x = contribution(rank, shape, dtype) / 3
    out = hvd.reducescatter(x, op=hvd.Sum, compression=hvd.Compression.fp16,
                            name=f"rs.fp16.{dtype}")
    sent = [(contribution(r, shape, dtype) / 3).to(torch.float16).double() for r in range(size)]
    total = torch.stack(sent).sum(0).to(torch.float16).to(dtype)
    counts = [(size + 1) // size + (1 if r < (size + 1) % size else 0) for r in range(size)]
    assert out.dtype == dtype
    torch.testing.assert_close(out, total[sum(counts[:rank]) : sum(counts[: rank + 1])])


@pytest.mark.parametrize("variant", RS_VARIANTS)
@pytest.mark.parametrize("op_name", ["Min", "Max", "Product", "Adasum"])
def test_reducescatter_unsupported_op(op_name: str, variant: str) -> None:
    op = {"Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product, "Adasum": hvd.Adasum}[op_name]
    with pytest.raises(hvd.HorovodInternalError,
                       match="Reducescatter currently only supports AVERAGE and SUM."):
        run_reducescatter(variant, torch.ones(4, 2), op=op)


@pytest.mark.parametrize("variant", RS_VARIANTS)
def test_reducescatter_scalar(variant: str) -> None:
    with pytest.raises(ValueError, match="Reducescatter does not support scalar inputs"):
        run_reducescatter(variant, torch.tensor(1.0))


@pytest.mark.parametrize("variant", RS_VARIANTS)
def test_reducescatter_unsupported_dtype_and_layout(variant: str) -> None:
    with pytest.raises(ValueError, match="Tensor type torch.ByteTensor is not supported."):
        run_reducescatter(variant, torch.ones(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="Tensor is required to be contiguous."):
        run_reducescatter(variant, torch.ones(3, 4).t())


def test_library_usable_after_errors(rank: int, size: int) -> None:
    out = hvd.reducescatter(torch.full((size, 1), float(rank)), op=hvd.Sum)
    assert torch.equal(out, torch.full((1, 1), float(sum(range(size)))))
    gathered = hvd.alltoall(torch.full((size,), rank, dtype=torch.int32))
    assert torch.equal(gathered, torch.arange(size, dtype=torch.int32))
