"""A float32 tensor scaled by a factor that is itself a float32 number (``1/size`` for a
power-of-two size) takes a float32 multiplication instead of the float64 loop: the product
of two float32 numbers is exact in float64, so the single rounding is the same. Checked
against the float64 oracle over normal, subnormal, huge and special values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baguahvd.engine.execution import scaling


def _oracle(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return (tensor.to(torch.float64) * factor).to(torch.float32)


def _values() -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    normal = torch.randn(50_000, generator=generator, dtype=torch.float64) * 100
    bits = torch.randint(0, 2**31 - 1, (50_000,), generator=generator, dtype=torch.int64)
    # Every float32 bit pattern class: subnormals, huge values, infinities, NaN, -0.
    raw = bits.to(torch.int32).view(torch.float32)
    tiny = torch.tensor([1e-45, -1e-45, 1e-40, 1.1754942e-38, 3.4e38, -3.4e38, -0.0, 0.0,
                         float("inf"), float("-inf"), float("nan")], dtype=torch.float32)
    return torch.cat([normal.to(torch.float32), raw, -raw, tiny])


@pytest.mark.parametrize("factor", [0.5, 0.25, 0.125, 1.0 / 1024, 2.0, 3.0, 0.75, 2.0**-140])
def test_float32_factors_scale_as_the_float64_oracle(factor: float) -> None:
    assert scaling.exact_in_float32(factor)
    tensor = _values()
    expected = _oracle(tensor, factor)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        scaling.scale_(tensor, factor)
    torch.testing.assert_close(tensor, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("factor", [1.0 / 3, 0.1, 1e300, 1e-300, float("nan")])
def test_other_factors_are_not_float32_numbers(factor: float) -> None:
    assert not scaling.exact_in_float32(factor)
