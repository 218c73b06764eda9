"""The Lightning strategy's pure parts, in one process: reduce ops, registration, eager
validation of ``algorithm=``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

import baguahvd.torch as hvd  # noqa: E402
from baguahvd.algorithms import ByteGradAlgorithm  # noqa: E402
from baguahvd.lightning import BaguaHvdStrategy  # noqa: E402
from baguahvd.lightning.rules import reduce_op_of  # noqa: E402


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, hvd.Average),
        ("mean", hvd.Average),
        ("avg", hvd.Average),
        ("SUM", hvd.Sum),
        ("max", hvd.Max),
        ("min", hvd.Min),
        (torch.distributed.ReduceOp.SUM, hvd.Sum),
        (torch.distributed.ReduceOp.MAX, hvd.Max),
    ],
)
def test_reduce_ops(given: object, expected: int) -> None:
    assert reduce_op_of(given) == expected  # type: ignore[arg-type]


def test_unsupported_reduce_op_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="'band'.*use one of avg, max, mean, min, product, sum"):
        reduce_op_of("band")


def test_registered_under_baguahvd() -> None:
    assert "baguahvd" in StrategyRegistry.available_strategies()
    assert isinstance(StrategyRegistry.get("baguahvd"), BaguaHvdStrategy)


def test_algorithm_is_resolved_when_constructed() -> None:
    assert BaguaHvdStrategy().algorithm is None
    assert isinstance(BaguaHvdStrategy(algorithm="bytegrad").algorithm, ByteGradAlgorithm)
    given = ByteGradAlgorithm(hierarchical=False)
    assert BaguaHvdStrategy(algorithm=given).algorithm is given
    with pytest.raises(ValueError, match="Unknown algorithm 'nope'; known algorithms: "):
        BaguaHvdStrategy(algorithm="nope")
