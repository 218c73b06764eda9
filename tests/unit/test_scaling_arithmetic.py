"""The engine scales as Horovod does: every element times the factor in float64, rounded
once to the tensor's dtype (integers truncated toward zero), for Average's ``1/size`` and
for pre/post scale factors. Checked against a float64 oracle at the sizes where ``1/size``
is not exact in binary."""

from __future__ import annotations

import pytest
import torch

from baguahvd.engine.execution import execute

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGERS = (torch.int32, torch.int64, torch.uint8)


def _oracle(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    wide = tensor.to(torch.float64) * factor
    if tensor.dtype.is_floating_point:
        return wide.to(tensor.dtype)
    return torch.trunc(wide).to(tensor.dtype)


def _values(dtype: torch.dtype, count: int = 100_000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    if dtype.is_floating_point:
        return (torch.randn(count, generator=generator, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(0, 200, (count,), generator=generator).to(dtype)


@pytest.mark.parametrize("size", [3, 5, 6, 7])
@pytest.mark.parametrize("dtype", FLOATING + INTEGERS, ids=str)
def test_average_scaling_rounds_once_from_float64(dtype: torch.dtype, size: int) -> None:
    tensor = _values(dtype)
    expected = _oracle(tensor, 1.0 / size)
    execute.scale_(tensor, 1.0 / size)
    assert torch.equal(tensor, expected)


@pytest.mark.parametrize("factor", [0.1, 1.7, 1.0 / 3 * 0.25])
@pytest.mark.parametrize("dtype", FLOATING + INTEGERS, ids=str)
def test_scale_factors_round_once_from_float64(dtype: torch.dtype, factor: float) -> None:
    tensor = _values(dtype)
    assert torch.equal(execute.scaled(tensor, factor), _oracle(tensor, factor))
    # Not contiguous: same numbers.
    strided = _values(dtype)[::2]
    expected = _oracle(strided, factor)
    execute.scale_(strided, factor)
    assert torch.equal(strided, expected)


def test_float32_arithmetic_would_differ() -> None:
    # Why it matters: scaling in float32 rounds 1/3 first, and about a quarter of the
    # elements end one ulp away from Horovod's.
    tensor = _values(torch.float32)
    in_float32 = tensor * (1.0 / 3)
    differing = (in_float32 != _oracle(tensor, 1.0 / 3)).sum().item()
    assert differing > len(tensor) // 10
