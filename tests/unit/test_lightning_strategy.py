"""The Lightning strategy's pure parts, in one process: reduce ops, registration, eager
validation of ``algorithm=``."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_both_packages_register_both_names() -> None:
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning.strategies

    import baguahvd.lightning.pytorch as for_lightning
    import baguahvd.lightning.pytorch_lightning as for_pytorch_lightning

    for registry, built in ((StrategyRegistry, for_lightning),
                            (pytorch_lightning.strategies.StrategyRegistry,
                             for_pytorch_lightning)):
        assert type(registry.get("baguahvd")) is built.BaguaHvdStrategy
        assert type(registry.get("bagua")) is built.BaguaStrategy
        assert isinstance(registry.get("bagua"), built.BaguaHvdStrategy)
    assert BaguaHvdStrategy is for_lightning.BaguaHvdStrategy


def test_bagua_arguments_build_the_algorithm() -> None:
    from baguahvd.algorithms import AsyncModelAverageAlgorithm, GradientAllReduceAlgorithm
    from baguahvd.lightning import BaguaStrategy

    assert isinstance(BaguaStrategy().algorithm, GradientAllReduceAlgorithm)
    strategy = BaguaStrategy(algorithm="async", sync_interval_ms=20, warmup_steps=3)
    assert isinstance(strategy.algorithm, AsyncModelAverageAlgorithm)
    assert (strategy.algorithm.sync_interval_ms, strategy.algorithm.warmup_steps) == (20, 3)
    with pytest.raises(TypeError, match="'bytegrad' does not take nope; it takes hierarchical"):
        BaguaStrategy(algorithm="bytegrad", nope=1)
    with pytest.raises(ValueError, match="Unknown algorithm 'nope'"):
        BaguaStrategy(algorithm="nope")
    with pytest.warns(UserWarning, match=r"flatten=False\) has no effect"):
        BaguaStrategy(flatten=False)


def test_devices_are_checked_against_the_launch() -> None:
    from baguahvd.lightning.rules import LaunchMismatchError, check_devices

    check_devices(1, 1, local_size=4, cross_size=2, size=8)
    check_devices(4, 2, local_size=4, cross_size=2, size=8)
    with pytest.raises(LaunchMismatchError, match=r"devices=3\) .* 4 rank\(s\) per machine"):
        check_devices(3, 1, local_size=4, cross_size=2, size=8)
    with pytest.raises(LaunchMismatchError, match=r"num_nodes=3\) .* 2 machine\(s\)"):
        check_devices(4, 3, local_size=4, cross_size=2, size=8)


def test_launch_kind_follows_the_launchers_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from baguahvd.lightning.rules import Launch, launch_kind

    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "HOROVOD_RANK", "RANK",
                 "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank Lightning's launcher started
    assert launch_kind() is Launch.LIGHTNING
    for name in ("OMPI_COMM_WORLD_RANK", "RANK", "SLURM_PROCID"):
        monkeypatch.setenv(name, "0")
        assert launch_kind() is Launch.EXTERNAL
        monkeypatch.delenv(name)


def test_lightning_bagua_stand_in_is_baguahvds_strategy() -> None:
    """On the path only when asked (the shim's folder), like the horovod stand-in."""
    from baguahvd.compat.aliases import shim_path
    from tests.support import jobs

    script = (
        "from lightning_bagua import BaguaStrategy\n"
        "from lightning_bagua.strategy import BaguaStrategy as FromModule\n"
        "import baguahvd.lightning\n"
        "assert BaguaStrategy is FromModule is baguahvd.lightning.BaguaStrategy\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([shim_path(), str(jobs.ROOT)]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
