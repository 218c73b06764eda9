"""Both Lightning packages on every rank: ``strategy="baguahvd"`` and lightning_bagua's
``strategy="bagua"``/``BaguaStrategy(algorithm=...)`` in ``lightning.pytorch`` and
``pytorch_lightning`` train to the same weights on every rank, and a Trainer whose
``devices`` contradict the launch, or an unknown algorithm, fails on every rank with a named
error before anything is communicated."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.utils.data

import baguahvd.torch as hvd

try:
    import baguahvd.lightning
    import baguahvd.lightning.pytorch
    import baguahvd.lightning.pytorch_lightning
    from tests.support.lightning_models import BATCH, dataset, flat, models_for, network
except ModuleNotFoundError as missing:
    if not (missing.name or "").startswith(("lightning", "pytorch_lightning")):
        raise
    LIGHTNING = False
else:
    LIGHTNING = True

# Skipped test by test rather than as a module, so that the mpirun driver sees tests that ran
# or were skipped, never none.
pytestmark = pytest.mark.skipif(
    not LIGHTNING, reason="needs lightning and pytorch-lightning (pip install baguahvd[test])"
)

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
STRATEGIES = {
    "lightning.pytorch": "baguahvd.lightning.pytorch",
    "pytorch_lightning": "baguahvd.lightning.pytorch_lightning",
}


def classes(package: str) -> Any:
    return importlib.import_module(STRATEGIES[package])


def trainer(package: str, strategy: Any, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    settings.update(kwargs)
    return importlib.import_module(package).Trainer(strategy=strategy, **settings)


def fit_identical(package: str, strategy: Any) -> Any:
    """Fits the test classifier and checks that every rank ends with the same trained
    weights; returns the Trainer."""
    model = models_for(package).Classifier()
    run = trainer(package, strategy)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    run.fit(model, loader)
    weights = hvd.allgather(flat(model).unsqueeze(0))
    assert torch.isfinite(weights).all()
    for other in weights[1:]:
        assert torch.equal(other, weights[0])
    assert not torch.equal(weights[0], flat(network()))
    return run


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("name", ["baguahvd", "bagua"])
def test_registered_names_train_identical_ranks(package: str, name: str) -> None:
    run = fit_identical(package, name)
    built = classes(package)
    expected = built.BaguaStrategy if name == "bagua" else built.BaguaHvdStrategy
    assert type(run.strategy) is expected
    assert (run.world_size, run.global_rank) == (hvd.size(), hvd.rank())


@pytest.mark.parametrize("package", PACKAGES)
def test_bagua_strategy_algorithm_trains_identical_ranks(package: str) -> None:
    fit_identical(package, classes(package).BaguaStrategy(algorithm="bytegrad"))


@pytest.mark.parametrize("package", PACKAGES)
def test_bagua_keyword_arguments_configure_the_algorithm(package: str) -> None:
    # Async averaging leaves the ranks apart; the strategy averages them when fitting ends.
    strategy = classes(package).BaguaStrategy(algorithm="async", sync_interval_ms=5)
    assert strategy.algorithm.sync_interval_ms == 5
    fit_identical(package, strategy)


@pytest.mark.parametrize("package", PACKAGES)
def test_unknown_algorithm_is_named_on_every_rank(package: str) -> None:
    known = "Unknown algorithm 'no_such'; known algorithms: .*bytegrad"
    with pytest.raises(ValueError, match=known):
        classes(package).BaguaStrategy(algorithm="no_such")
    with pytest.raises(ValueError, match="Unknown algorithm 'no_such'"):
        trainer(package, classes(package).BaguaHvdStrategy(algorithm="no_such"))


@pytest.mark.parametrize("package", PACKAGES)
def test_devices_that_contradict_the_launch_fail_on_every_rank(package: str) -> None:
    devices = hvd.local_size() + 1
    with pytest.raises(baguahvd.lightning.LaunchMismatchError,
                       match=rf"devices={devices}\) does not match the launch"):
        trainer(package, "baguahvd", devices=devices)
    with pytest.raises(baguahvd.lightning.LaunchMismatchError, match="num_nodes=2"):
        trainer(package, "bagua", num_nodes=hvd.cross_size() + 1)
    # Lightning's meaning of devices (the ranks per machine) is accepted too.
    run = trainer(package, "baguahvd", devices=hvd.local_size())
    assert run.world_size == hvd.size()
