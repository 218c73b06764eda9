"""Average and scale factors give Horovod's numbers at every job size: the reduced sum times
the factor in float64, rounded once (see tests/unit/test_scaling_arithmetic.py), also while
a rank has joined. Run at sizes 2, 3, 5 and 6 (tests/e2e/test_parallel.py)."""

from __future__ import annotations

import pytest
import torch

import baguahvd.torch as hvd

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _oracle(total: torch.Tensor, factor: float) -> torch.Tensor:
    return (total.to(torch.float64) * factor).to(total.dtype)


def _values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(1000, generator=generator, dtype=torch.float64) * 10).to(dtype)


@pytest.mark.parametrize("dtype", FLOATING, ids=str)
def test_average_is_the_sum_scaled_in_float64(rank: int, size: int, dtype: torch.dtype) -> None:
    tensor = _values(rank, dtype)
    total = hvd.allreduce(tensor, op=hvd.Sum, name=f"scaling.sum.{dtype}")
    average = hvd.allreduce(tensor, op=hvd.Average, name=f"scaling.avg.{dtype}")
    assert torch.equal(average, _oracle(total, 1.0 / size))


@pytest.mark.parametrize("dtype", FLOATING, ids=str)
def test_pre_and_post_factors_in_float64(rank: int, size: int, dtype: torch.dtype) -> None:
    tensor = _values(rank, dtype)
    pre, post = 0.3, 1.0 / 7
    prescaled = _oracle(tensor, pre)
    total = hvd.allreduce(prescaled, op=hvd.Sum, name=f"scaling.presum.{dtype}")
    result = hvd.allreduce(
        tensor, op=hvd.Average, prescale_factor=pre, postscale_factor=post,
        name=f"scaling.prepost.{dtype}",
    )
    assert torch.equal(result, _oracle(total, post / size))


@pytest.mark.parametrize("fused", [False, True], ids=["alone", "fused"])
def test_average_while_a_rank_has_joined(rank: int, size: int, fused: bool) -> None:
    # The last rank joins at once; the others average with its zeros, over the whole size.
    last = size - 1
    if rank != last:
        count = 3 if fused else 1
        tensors = [_values(rank + index, torch.float32) for index in range(count)]
        totals = hvd.grouped_allreduce(tensors, op=hvd.Sum, name=f"scaling.join.sum.{fused}")
        averages = hvd.grouped_allreduce(
            tensors, op=hvd.Average, name=f"scaling.join.avg.{fused}"
        )
        for average, total in zip(averages, totals):
            assert torch.equal(average, _oracle(total, 1.0 / size))
    hvd.join()
