"""Allreduce and grouped allreduce of CPU tensors: dtypes x ops, scale factors, the four
variants, fusion and the response cache, ordering, compression, Adasum and argument errors.

Every rank runs the same bodies; expected values are computed from ``rank`` and ``size``.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime
from tests.support.tables import REDUCE_OPS, REDUCIBLE

OPS = {op.name.title(): op for op in REDUCE_OPS}
VARIANTS = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_"]
GROUPED_VARIANTS = [
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
]
HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------
# Oracle


def contribution(
    rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0
) -> torch.Tensor:
    """Rank ``rank``'s input: small signed integers in [-3, 3], exact in every dtype, that
    differ across ranks so that Min, Max and Product are not trivial."""
    count = math.prod(shape)
    values = (torch.arange(count) * 3 + 7 * rank + salt) % 7 - 3
    return values.reshape(tuple(shape)).to(dtype)


def scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's scaling arithmetic: integers in float64 truncated toward zero, half types in
    float32 rounded once, float32/float64 in their own precision."""
    if not tensor.is_floating_point():
        return torch.trunc(tensor.double() * factor).to(tensor.dtype)
    if tensor.dtype in HALF:
        return (tensor.float() * factor).to(tensor.dtype)
    return tensor * factor


def expected_allreduce(
    inputs: Sequence[torch.Tensor], op: int, pre: float = 1.0, post: float = 1.0
) -> torch.Tensor:
    """``post * REDUCE(pre * x_r)``, with ``Average`` as ``Sum`` and ``post / size``."""
    dtype = inputs[0].dtype
    size = len(inputs)
    stacked = torch.stack([scaled(t, pre).double() for t in inputs])
    if op in (hvd.Sum, hvd.Average):
        reduced = stacked.sum(0)
    elif op == hvd.Min:
        reduced = stacked.amin(0)
    elif op == hvd.Max:
        reduced = stacked.amax(0)
    else:
        reduced = stacked.prod(0)
    result = reduced.to(dtype)
    if op == hvd.Average:
        if pre == 1.0 and post == 1.0 and not dtype.is_floating_point:
            return torch.div(result, size, rounding_mode="trunc")
        post = post / size
    return scaled(result, post) if post != 1.0 else result


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if expected.is_floating_point():
        torch.testing.assert_close(actual, expected)
    else:
        assert torch.equal(actual, expected), f"{actual} != {expected}"


def run_variant(variant: str, tensor: Any, **kwargs: Any) -> Any:
    """Runs one of the four allreduce variants and checks its object identity contract."""
    original = tensor.clone() if isinstance(tensor, torch.Tensor) else None
    if variant == "allreduce":
        out = hvd.allreduce(tensor, **kwargs)
    elif variant == "allreduce_":
        out = hvd.allreduce_(tensor, **kwargs)
    elif variant == "allreduce_async":
        handle = hvd.allreduce_async(tensor, **kwargs)
        out = hvd.synchronize(handle)
    else:
        handle = hvd.allreduce_async_(tensor, **kwargs)
        out = hvd.synchronize(handle)
    if variant.endswith("_"):
        assert out is tensor
    else:
        assert out is not tensor
        assert torch.equal(tensor, original), "out-of-place allreduce modified its input"
    return out


def run_grouped(variant: str, tensors: list[torch.Tensor], **kwargs: Any) -> Any:
    originals = [t.clone() for t in tensors]
    if variant == "grouped_allreduce":
        out = hvd.grouped_allreduce(tensors, **kwargs)
        assert isinstance(out, list)
    elif variant == "grouped_allreduce_":
        out = hvd.grouped_allreduce_(tensors, **kwargs)
        assert isinstance(out, tuple)
    elif variant == "grouped_allreduce_async":
        out = hvd.synchronize(hvd.grouped_allreduce_async(tensors, **kwargs))
        assert isinstance(out, tuple)
    else:
        out = hvd.synchronize(hvd.grouped_allreduce_async_(tensors, **kwargs))
        assert isinstance(out, tuple)
    assert len(out) == len(tensors)
    for result, tensor, original in zip(out, tensors, originals):
        if variant.endswith("_"):
            assert result is tensor
        else:
            assert result is not tensor
            assert torch.equal(tensor, original)
    return out


# ---------------------------------------------------------------------------------------
# dtype x op x variant


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
def test_allreduce_dtype_op(dtype: torch.dtype, op_name: str, variant: str, rank: int,
                            size: int) -> None:
    op = OPS[op_name]
    shape = (3, 5)
    x = contribution(rank, shape, dtype)
    out = run_variant(variant, x, op=op, name=f"dtype_op.{variant}.{dtype}.{op_name}")
    expected = expected_allreduce([contribution(r, shape, dtype) for r in range(size)], op)
    assert_matches(out, expected)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_integer_average_truncates_toward_zero(dtype: torch.dtype, rank: int, size: int) -> None:
    values = torch.tensor([1, -1, 4, -4, 5, -5, 7, -7], dtype=dtype)
    x = values if rank == 0 else torch.zeros_like(values)
    out = hvd.allreduce(x, op=hvd.Average, name=f"int_average.{dtype}")
    assert torch.equal(out, torch.div(values, size, rounding_mode="trunc"))


@pytest.mark.parametrize("factors", [(0.5, 3.0), (3.0, 0.5)], ids=str)
@pytest.mark.parametrize("op_name", ["Sum", "Average", "Min"])
@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
def test_allreduce_prescale_postscale(dtype: torch.dtype, op_name: str,
                                      factors: tuple[float, float], rank: int,
                                      size: int) -> None:
    pre, post = factors
    op = OPS[op_name]
    x = contribution(rank, (13,), dtype)
    out = hvd.allreduce(
        x, op=op, prescale_factor=pre, postscale_factor=post,
        name=f"scale.{dtype}.{op_name}.{pre}.{post}",
    )
    inputs = [contribution(r, (13,), dtype) for r in range(size)]
    assert_matches(out, expected_allreduce(inputs, op, pre, post))


@pytest.mark.parametrize("variant", VARIANTS)
def test_integer_prescale_truncates_on_every_rank(variant: str, rank: int, size: int) -> None:
    x = torch.tensor([5, -5, 7, -7, 1], dtype=torch.int32)
    out = run_variant(variant, x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=1.0,
                      name=f"int_prescale.{variant}")
    # Each rank's 0.5 * x is truncated before the sum: [2, -2, 3, -3, 0].
    assert torch.equal(out, torch.tensor([2, -2, 3, -3, 0], dtype=torch.int32) * size)


def test_float16_scaling_rounds_prescaled_inputs(rank: int, size: int) -> None:
    x = torch.tensor([1.0, 3.0, -2.0, 1000.0], dtype=torch.float16)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=1 / 3, postscale_factor=1.5,
                        name="fp16_scale")
    each = (x.float() * (1 / 3)).to(torch.float16)
    expected = ((each.float() * size).to(torch.float16).float() * 1.5).to(torch.float16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------------------------------
# The deprecated average flag


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("average", [True, False])
def test_average_flag_is_deprecated(average: bool, variant: str, rank: int, size: int) -> None:
    x = contribution(rank, (6,), torch.float32)
    with pytest.warns(DeprecationWarning, match="Parameter `average` has been replaced with `op`"):
        out = run_variant(variant, x, average=average, name=f"average_flag.{variant}.{average}")
    op = hvd.Average if average else hvd.Sum
    expected = expected_allreduce([contribution(r, (6,), torch.float32) for r in range(size)], op)
    assert_matches(out, expected)


def test_op_none_means_average(rank: int, size: int) -> None:
    x = contribution(rank, (6,), torch.float64)
    out = hvd.allreduce(x, name="op_none")
    inputs = [contribution(r, (6,), torch.float64) for r in range(size)]
    assert_matches(out, expected_allreduce(inputs, hvd.Average))


@pytest.mark.parametrize("variant", VARIANTS + GROUPED_VARIANTS)
def test_op_and_average_together_is_an_error(variant: str) -> None:
    x = torch.ones(3)
    message = "The op parameter supersedes average. Please provide only one of them."
    with pytest.raises(ValueError, match=re.escape(message)):
        if variant.startswith("grouped"):
            run_grouped(variant, [x], average=True, op=hvd.Sum)
        else:
            run_variant(variant, x, average=False, op=hvd.Sum)


# ---------------------------------------------------------------------------------------
# Shapes


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "shape, dtype",
    [((), torch.float32), ((1,), torch.int64), ((2, 3, 4), torch.float32),
     ((2, 1, 3, 1, 2), torch.int64), ((0,), torch.float32), ((3, 0), torch.int64),
     ((0, 4, 2), torch.float16)],
    ids=str,
)
def test_allreduce_shapes(dtype: torch.dtype, shape: tuple[int, ...], variant: str, rank: int,
                          size: int) -> None:
    x = contribution(rank, shape, dtype)
    out = run_variant(variant, x, op=hvd.Sum, name=f"shape.{variant}.{dtype}.{shape}")
    inputs = [contribution(r, shape, dtype) for r in range(size)]
    assert_matches(out, expected_allreduce(inputs, hvd.Sum))


def test_out_of_place_allreduce_leaves_input_unchanged(rank: int, size: int) -> None:
    x = contribution(rank, (4, 4), torch.float32)
    before = x.clone()
    pointer = x.data_ptr()
    out = hvd.allreduce(x, op=hvd.Sum, name="unchanged")
    handle = hvd.allreduce_async(x, op=hvd.Max, name="unchanged.async")
    out_async = hvd.synchronize(handle)
    assert torch.equal(x, before)
    assert x.data_ptr() == pointer
    assert out.data_ptr() != pointer and out_async.data_ptr() != pointer


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("dtype", "count"),
    [(torch.float32, (1 << 18) + 5), (torch.int64, (1 << 17) + 3),
     (torch.bfloat16, (1 << 18) + 1), (torch.float32, (8 << 20) + 7)],
    ids=str,
)
def test_large_allreduce(dtype: torch.dtype, count: int, variant: str, rank: int,
                         size: int) -> None:
    """Sizes that the MPI data plane reduces in its own ring (1 MB and more out of place,
    32 MB and more in place), with block sizes that do not divide evenly."""
    inputs = [contribution(r, (count,), dtype) for r in range(size)]
    ops = ("Sum", "Max") if count > 1 << 20 else tuple(OPS)
    for op_name in ops:
        op = OPS[op_name]
        out = run_variant(variant, inputs[rank].clone(), op=op,
                          name=f"large.{variant}.{dtype}.{count}.{op_name}")
        assert_matches(out, expected_allreduce(inputs, op))
    out = run_variant(variant, inputs[rank].clone(), op=hvd.Average, prescale_factor=0.5,
                      postscale_factor=3.0, name=f"large.scaled.{variant}.{dtype}.{count}")
    assert_matches(out, expected_allreduce(inputs, hvd.Average, 0.5, 3.0))


# ---------------------------------------------------------------------------------------
# Grouped allreduce


@pytest.mark.parametrize("variant", ["grouped_allreduce", "grouped_allreduce_async_"])
@pytest.mark.parametrize("op_name", ["Sum", "Average", "Max", "Product"])
@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
def test_grouped_allreduce(dtype: torch.dtype, op_name: str, variant: str, rank: int,
                           size: int) -> None:
    op = OPS[op_name]
    shapes = [(3,), (2, 4), (0,), (5, 1, 2), ()]
    tensors = [contribution(rank, s, dtype, salt=i) for i, s in enumerate(shapes)]
    out = run_grouped(variant, tensors, op=op, name=f"grouped.{variant}.{dtype}.{op_name}")
    for i, (shape, result) in enumerate(zip(shapes, out)):
        inputs = [contribution(r, shape, dtype, salt=i) for r in range(size)]
        assert_matches(result, expected_allreduce(inputs, op))


@pytest.mark.parametrize("variant", GROUPED_VARIANTS)
def test_grouped_allreduce_scaled_unnamed(variant: str, rank: int, size: int) -> None:
    shapes = [(7,), (2, 2)]
    tensors = [contribution(rank, s, torch.int32, salt=i) for i, s in enumerate(shapes)]
    out = run_grouped(variant, tensors, op=hvd.Average, prescale_factor=0.5,
                      postscale_factor=3.0)
    for i, (shape, result) in enumerate(zip(shapes, out)):
        inputs = [contribution(r, shape, torch.int32, salt=i) for r in range(size)]
        assert_matches(result, expected_allreduce(inputs, hvd.Average, 0.5, 3.0))


def test_grouped_allreduce_async_submitted_together(rank: int, size: int) -> None:
    groups = [[contribution(rank, (i + 1, 2), torch.float32, salt=10 * i + j) for j in range(3)]
              for i in range(8)]
    handles = [hvd.grouped_allreduce_async(g, op=hvd.Sum, name=f"groups.{i}")
               for i, g in enumerate(groups)]
    for i in reversed(range(len(groups))):
        out = hvd.synchronize(handles[i])
        for j, result in enumerate(out):
            inputs = [contribution(r, (i + 1, 2), torch.float32, salt=10 * i + j)
                      for r in range(size)]
            assert_matches(result, expected_allreduce(inputs, hvd.Sum))


# ---------------------------------------------------------------------------------------
# Many requests at once: fusion, the response cache and its invalidation


# The bursts below check hundreds of results, so their inputs are chosen to make the
# expected values cheap: rank r sends ``pattern + level + r`` with ``pattern`` in [0, 4) along
# the tensor, and every Sum, Average and Max of that is exact in every dtype.


def _burst_input(rank: int, shape: Sequence[int], dtype: torch.dtype, level: int
                 ) -> torch.Tensor:
    return (torch.arange(math.prod(shape)) % 4 + (level + rank)).reshape(tuple(shape)).to(dtype)


def _burst_expected(size: int, shape: Sequence[int], dtype: torch.dtype, level: int, op: int
                    ) -> torch.Tensor:
    pattern = (torch.arange(math.prod(shape)) % 4 + level).double()
    if op == hvd.Sum:
        result = pattern * size + size * (size - 1) // 2
    elif op == hvd.Max:
        result = pattern + size - 1
    elif dtype.is_floating_point:  # Average
        result = pattern + (size - 1) / 2
    else:
        result = pattern + (size - 1) // 2  # truncated
    return result.reshape(tuple(shape)).to(dtype)


def _burst_spec(index: int, iteration: int) -> tuple[tuple[int, ...], torch.dtype, int]:
    shape: tuple[int, ...] = (index % 7 + 1,)
    if iteration == 2 and index in (17, 150):
        shape = (3, 5)  # the cached response for these names no longer fits
    dtypes = (torch.float32, torch.int32, torch.float64, torch.float16, torch.bfloat16)
    dtype = dtypes[index % len(dtypes)]
    if iteration == 3 and index == 42:
        dtype = torch.int64  # ... nor for this one
    op = (hvd.Sum, hvd.Average, hvd.Max)[index % 3]
    return shape, dtype, op


def test_fused_burst_uses_and_invalidates_cache(rank: int, size: int) -> None:
    count = 300
    shuffler = random.Random(rank)
    for iteration in range(5):
        handles = []
        for i in range(count):
            shape, dtype, op = _burst_spec(i, iteration)
            x = _burst_input(rank, shape, dtype, level=(i + iteration) % 50)
            handles.append(hvd.allreduce_async(x, op=op, name=f"burst.{i}"))
        order = list(range(count))
        if iteration % 2:
            shuffler.shuffle(order)
        else:
            order.reverse()
        for i in order:
            shape, dtype, op = _burst_spec(i, iteration)
            out = hvd.synchronize(handles[i])
            expected = _burst_expected(size, shape, dtype, (i + iteration) % 50, op)
            assert out.dtype == dtype and torch.equal(out, expected), (i, out, expected)


def test_fused_units_of_several_megabytes_are_exact(rank: int, size: int) -> None:
    # Units large enough for the fusion buffer's huge pages, in three dtypes at once, with
    # tensors of odd sizes that cut across the buffer's 2 MB pages; out of place and in place.
    sizes = [(1 << 20) + 3, 5, (1 << 19) - 1, 3 * (1 << 18) + 7, 1, (1 << 20) - 5]
    dtypes = (torch.float32, torch.float64, torch.int32)
    for in_place in (False, True):
        handles = []
        for d, dtype in enumerate(dtypes):
            for i, count in enumerate(sizes):
                x = _burst_input(rank, (count,), dtype, level=i + d)
                start = hvd.allreduce_async_ if in_place else hvd.allreduce_async
                handles.append((x, start(x, op=hvd.Sum, name=f"big.{in_place}.{d}.{i}")))
        for index, (x, handle) in enumerate(handles):
            d, i = divmod(index, len(sizes))
            out = hvd.synchronize(handle)
            assert (out is x) == in_place
            expected = _burst_expected(size, (sizes[i],), dtypes[d], i + d, hvd.Sum)
            assert out.dtype == dtypes[d] and torch.equal(out, expected), (d, i)


def test_more_names_than_cache_entries(rank: int, size: int) -> None:
    # More names than the response cache holds (HOROVOD_CACHE_CAPACITY, 1024 by default):
    # entries that requests were admitted against get evicted to make room for others.
    count = 1100
    for iteration in range(3):
        handles = [
            hvd.allreduce_async(torch.full((2,), float(i + iteration + rank)), op=hvd.Sum,
                                name=f"lru.{i}")
            for i in range(count)
        ]
        out = torch.stack([hvd.synchronize(handle) for handle in handles])
        levels = (torch.arange(count, dtype=torch.float32) + iteration) * size
        expected = (levels + size * (size - 1) // 2).unsqueeze(1).expand(count, 2)
        assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------
# Unnamed requests and the response cache: paired by their order, answered from the cache


def _unnamed_value(index: int, rank: int) -> float:
    return float(100 * index + rank)


def _unnamed_expected(index: int, size: int) -> float:
    return float(100 * index * size + size * (size - 1) // 2)


def test_unnamed_allreduces_of_known_shapes_run_from_the_cache(rank: int, size: int) -> None:
    engine = runtime.require_engine()
    specs = [((5,), torch.float32, hvd.Sum), ((3, 2), torch.float64, hvd.Sum),
             ((5,), torch.float32, hvd.Max)]
    for _ in range(2):  # the first round is negotiated in full and cached
        for shape, dtype, op in specs:
            hvd.allreduce(torch.ones(shape, dtype=dtype), op=op)
    before = engine.full_negotiations
    for index in range(30):
        shape, dtype, op = specs[index % len(specs)]
        out = hvd.allreduce(torch.full(shape, _unnamed_value(index, rank), dtype=dtype), op=op)
        expected = (_unnamed_expected(index, size) if op == hvd.Sum
                    else _unnamed_value(index, size - 1))
        assert torch.equal(out, torch.full(shape, expected, dtype=dtype)), (index, out)
    # Every one of the 30 ran from the cache; a stall check may still go to rank 0 once.
    assert engine.full_negotiations - before <= 1


def test_unnamed_broadcasts_run_from_the_cache(rank: int, size: int) -> None:
    engine = runtime.require_engine()
    roots = [0, size - 1]
    for root in roots:  # negotiated in full once per root, then cached
        hvd.broadcast(torch.zeros(6), root)
    before = engine.full_negotiations
    for index in range(20):
        root = roots[index % 2]
        out = hvd.broadcast(torch.full((6,), _unnamed_value(index, rank)), root)
        assert torch.equal(out, torch.full((6,), _unnamed_value(index, root))), (index, out)
    assert engine.full_negotiations - before <= 1
    # Ranks that name different roots for the same cached shape fail, every one of them.
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched.*root"):
        hvd.broadcast(torch.zeros(6), 0 if rank == 0 else size - 1)
    out = hvd.broadcast(torch.full((6,), float(rank)), size - 1)
    assert torch.equal(out, torch.full((6,), float(size - 1)))


def test_a_burst_of_unnamed_in_place_allreduces_runs_from_the_cache(
    rank: int, size: int
) -> None:
    # One cache entry per position in the burst: after the first burst, a burst of unnamed
    # calls of the same shapes is agreed without rank 0, however many calls it holds.
    # One shape: a burst that some rank submits across two cycles is then looked up at
    # positions that the first burst already cached (with shapes that vary by position, a
    # split at another place asks for entries not seen yet, and goes to rank 0 once).
    engine = runtime.require_engine()
    count = 150
    tensors = [torch.zeros(6) for _ in range(count)]
    for round_ in range(6):
        if round_ == 2:
            before = engine.full_negotiations
        for index, tensor in enumerate(tensors):
            tensor.fill_(_unnamed_value(index + round_, rank))
        handles = [hvd.allreduce_async_(tensor, op=hvd.Sum) for tensor in tensors]
        for index, handle in enumerate(handles):
            out = hvd.synchronize(handle)
            assert out is tensors[index]
            expected = torch.full_like(out, _unnamed_expected(index + round_, size))
            assert torch.equal(out, expected), (round_, index, out)
    # A stall check may still go to rank 0 once.
    assert engine.full_negotiations - before <= 1


def test_unnamed_calls_pair_in_order_when_ranks_submit_differently(
    rank: int, size: int
) -> None:
    # Rank 0 waits for each call, the others submit the whole sequence at once (their later
    # calls go to rank 0 in full while rank 0's oldest waits on the cache); one rank is
    # late now and then. Every result must still pair the n-th call of every rank.
    count = 40
    hvd.allreduce(torch.ones(4), op=hvd.Sum)  # cached shape
    for round_ in range(3):
        if rank == 0:
            results = []
            for index in range(count):
                results.append(hvd.allreduce(
                    torch.full((4,), _unnamed_value(index + round_, rank)), op=hvd.Sum))
        else:
            handles = []
            for index in range(count):
                if rank == size - 1 and index % 9 == 0:
                    time.sleep(0.01)
                handles.append(hvd.allreduce_async(
                    torch.full((4,), _unnamed_value(index + round_, rank)), op=hvd.Sum))
            results = [hvd.synchronize(handle) for handle in handles]
        for index, out in enumerate(results):
            expected = torch.full((4,), _unnamed_expected(index + round_, size))
            assert torch.equal(out, expected), (round_, index, out)


def test_unnamed_mismatch_between_cached_shapes_fails_on_every_rank(
    rank: int, size: int
) -> None:
    # Both shapes are in the cache, so every rank's request waits on a cached entry, each
    # on a different one: they must go to rank 0, which names the mismatch.
    for _ in range(2):
        hvd.allreduce(torch.ones(4), op=hvd.Sum)
        hvd.allreduce(torch.ones(5), op=hvd.Sum)
    length = 5 if rank == size - 1 else 4
    started = time.monotonic()
    with pytest.raises(hvd.HorovodInternalError, match=r"Mismatched.*\[4\].*\[5\]"):
        hvd.allreduce(torch.ones(length), op=hvd.Sum)
    assert time.monotonic() - started < 10
    out = hvd.allreduce(torch.ones(4), op=hvd.Sum)
    assert torch.equal(out, torch.full((4,), float(size)))


def test_unnamed_request_late_on_one_rank_waits_for_it(rank: int, size: int) -> None:
    hvd.allreduce(torch.ones(3), op=hvd.Sum)
    hvd.allreduce(torch.ones(3), op=hvd.Sum)
    if rank == size - 1:
        time.sleep(0.3)  # the others' requests wait on the cache for many cycles
    out = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum)
    assert torch.equal(out, torch.full((3,), float(size * (size - 1) // 2)))


def test_burst_in_place_with_scale_factors(rank: int, size: int) -> None:
    tensors = [contribution(rank, (i % 5 + 1, 3), torch.float32, salt=i) for i in range(120)]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25,
                                    name=f"burst_inplace.{i}") for i, t in enumerate(tensors)]
    for i, handle in enumerate(handles):
        assert hvd.synchronize(handle) is tensors[i]
        inputs = [contribution(r, (i % 5 + 1, 3), torch.float32, salt=i) for r in range(size)]
        assert_matches(tensors[i], expected_allreduce(inputs, hvd.Sum, 2.0, 0.25))


def test_poll_is_false_right_after_submission(rank: int, size: int) -> None:
    saw_pending = False
    handles = []
    for i in range(20):
        handle = hvd.allreduce_async(torch.full((1000,), float(rank + i)), op=hvd.Sum,
                                     name=f"poll.{i}")
        saw_pending = saw_pending or not hvd.poll(handle)
        handles.append(handle)
    assert saw_pending, "poll() was True for every request right after submission"
    last = handles[-1]
    deadline = time.monotonic() + 60
    while not hvd.poll(last):
        assert time.monotonic() < deadline, "the last request never completed"
        time.sleep(0.001)
    total = sum(range(size))
    for i, handle in enumerate(handles):
        out = hvd.synchronize(handle)
        assert torch.equal(out, torch.full((1000,), float(total + size * i)))
    assert hvd.synchronize(last) is None
    with pytest.raises(ValueError):
        hvd.poll(last)


@pytest.mark.parametrize("ordering", ["reversed_on_odd_ranks", "shuffled_per_rank"])
def test_named_requests_in_rank_dependent_order(ordering: str, rank: int, size: int) -> None:
    names = list(range(60))
    if ordering == "reversed_on_odd_ranks":
        order = names[::-1] if rank % 2 else names
    else:
        order = names[:]
        random.Random(100 + rank).shuffle(order)
    handles = {}
    for i in order:
        x = contribution(rank, (i % 4 + 1,), torch.float32, salt=i)
        handles[i] = hvd.allreduce_async(x, op=hvd.Sum, name=f"order.{ordering}.{i}")
    for i in names:
        inputs = [contribution(r, (i % 4 + 1,), torch.float32, salt=i) for r in range(size)]
        assert_matches(hvd.synchronize(handles[i]), expected_allreduce(inputs, hvd.Sum))


def test_blocking_named_requests_after_reordered_async(rank: int, size: int) -> None:
    # An odd rank's blocking request is another rank's async one, and the other way round.
    ops = {"early": hvd.Sum, "late": hvd.Max}
    first, second = ("late", "early") if rank % 2 else ("early", "late")
    handle = hvd.allreduce_async(torch.full((3,), float(rank)), op=ops[first],
                                 name=f"mixed.{first}")
    out = hvd.allreduce(torch.full((3,), float(rank)), op=ops[second], name=f"mixed.{second}")
    results = {first: hvd.synchronize(handle), second: out}
    assert torch.equal(results["early"], torch.full((3,), float(sum(range(size)))))
    assert torch.equal(results["late"], torch.full((3,), float(size - 1)))


def test_unnamed_requests(rank: int, size: int) -> None:
    handles = [hvd.allreduce_async(contribution(rank, (5,), torch.int64, salt=i), op=hvd.Sum)
               for i in range(25)]
    blocking = hvd.allreduce(contribution(rank, (2, 2), torch.float32), op=hvd.Min)
    for i in reversed(range(len(handles))):
        inputs = [contribution(r, (5,), torch.int64, salt=i) for r in range(size)]
        assert_matches(hvd.synchronize(handles[i]), expected_allreduce(inputs, hvd.Sum))
    inputs = [contribution(r, (2, 2), torch.float32) for r in range(size)]
    assert_matches(blocking, expected_allreduce(inputs, hvd.Min))


# ---------------------------------------------------------------------------------------
# Compression


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32], ids=str)
@pytest.mark.parametrize(
    "compression, wire",
    [(hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)],
    ids=["fp16", "bf16"],
)
def test_compression(compression: Any, wire: torch.dtype, dtype: torch.dtype, op_name: str,
                     grouped: bool, rank: int, size: int) -> None:
    op = OPS[op_name]

    def value(r: int) -> torch.Tensor:
        x = contribution(r, (4, 3), dtype)
        return x / 3 if dtype.is_floating_point else x  # thirds are not exact on the wire

    x = value(rank)
    name = f"compressed.{wire}.{dtype}.{op_name}.{grouped}"
    if grouped:
        out = hvd.grouped_allreduce([x, x + 1], op=op, compression=compression, name=name)[0]
    else:
        out = hvd.allreduce(x, op=op, compression=compression, name=name)
    if dtype.is_floating_point:
        sent = [value(r).to(wire) for r in range(size)]
        expected = expected_allreduce(sent, op).to(dtype)
    else:
        expected = expected_allreduce([value(r) for r in range(size)], op)
    assert out.dtype == dtype
    assert_matches(out, expected)
    assert torch.equal(x, value(rank))


# ---------------------------------------------------------------------------------------
# Adasum


def adasum_oracle(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adasum's pairwise combination applied as a binary tree over the ranks in order:
    (0, 1), (2, 3), ... then the pairs of pairs."""
    level = [v.double().reshape(-1) for v in vectors]
    while len(level) > 1:
        combined = []
        for a, b in zip(level[0::2], level[1::2]):
            dot = torch.dot(a, b)
            combined.append((1 - dot / (2 * torch.dot(a, a))) * a
                            + (1 - dot / (2 * torch.dot(b, b))) * b)
        level = combined
    return level[0]


def _adasum_input(kind: str, r: int, size: int) -> torch.Tensor:
    if kind == "random":
        generator = torch.Generator().manual_seed(1234 + r)
        return torch.randn(3, 4, generator=generator, dtype=torch.float64)
    if kind == "identical":
        return torch.arange(1.0, 13.0, dtype=torch.float64).reshape(3, 4)
    x = torch.zeros(3, 4, dtype=torch.float64)  # orthogonal: rank r owns element r
    x.view(-1)[r] = r + 1.0
    return x


@pytest.mark.parametrize("kind", ["random", "identical", "orthogonal"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_adasum(dtype: torch.dtype, variant: str, kind: str, rank: int, size: int) -> None:
    x = _adasum_input(kind, rank, size).to(dtype)
    name = f"adasum.{dtype}.{variant}.{kind}"
    if size & (size - 1):
        with pytest.raises(NotImplementedError,
                           match="Running Adasum with non-power of 2 ranks is not supported yet."):
            run_variant(variant, x, op=hvd.Adasum, name=name)
        return
    out = run_variant(variant, x, op=hvd.Adasum, name=name)
    inputs = [_adasum_input(kind, r, size).to(dtype) for r in range(size)]
    expected = adasum_oracle(inputs).reshape(3, 4).to(dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected)
    if kind == "identical":  # Adasum of equal vectors is that vector
        torch.testing.assert_close(out, x)
    elif kind == "orthogonal":  # ... and of orthogonal vectors their sum
        torch.testing.assert_close(out, sum(inputs))


# ---------------------------------------------------------------------------------------
# Argument errors (raised on the calling rank, before any communication)


@pytest.mark.parametrize("variant", VARIANTS + GROUPED_VARIANTS)
@pytest.mark.parametrize(
    "dtype, type_name",
    [
        (torch.bool, "torch.BoolTensor"),
        (torch.uint8, "torch.ByteTensor"),
        (torch.int8, "torch.CharTensor"),
        (torch.int16, "torch.ShortTensor"),
        (torch.complex64, "torch.ComplexFloatTensor"),
    ],
    ids=["bool", "uint8", "int8", "int16", "complex64"],
)
def test_unsupported_dtype(dtype: torch.dtype, type_name: str, variant: str) -> None:
    x = torch.zeros(4, dtype=dtype)
    with pytest.raises(ValueError, match=re.escape(f"Tensor type {type_name} is not supported.")):
        if variant.startswith("grouped"):
            run_grouped(variant, [x], op=hvd.Sum)
        else:
            run_variant(variant, x, op=hvd.Sum)


@pytest.mark.parametrize("variant", VARIANTS + GROUPED_VARIANTS)
def test_non_contiguous(variant: str) -> None:
    x = torch.arange(12.0).reshape(3, 4).t()
    assert not x.is_contiguous()
    with pytest.raises(ValueError, match="Tensor is required to be contiguous."):
        if variant.startswith("grouped"):
            run_grouped(variant, [torch.ones(3, 4).t().contiguous(), x], op=hvd.Sum)
        else:
            run_variant(variant, x, op=hvd.Sum)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("value", [[1.0, 2.0], 3.0, None], ids=["list", "float", "None"])
def test_non_tensor(value: Any, variant: str) -> None:
    calls = {
        "allreduce": hvd.allreduce,
        "allreduce_": hvd.allreduce_,
        "allreduce_async": hvd.allreduce_async,
        "allreduce_async_": hvd.allreduce_async_,
    }
    with pytest.raises(TypeError):
        calls[variant](value, op=hvd.Sum)


def test_library_usable_after_errors(rank: int, size: int) -> None:
    x = contribution(rank, (3,), torch.float32)
    out = hvd.allreduce(x, op=hvd.Sum)
    assert_matches(out, expected_allreduce([contribution(r, (3,), torch.float32)
                                            for r in range(size)], hvd.Sum))
