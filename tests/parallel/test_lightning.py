"""``Trainer(strategy="baguahvd")`` on every rank: the fitted weights, logged metrics,
checkpoints and the Bagua algorithms, compared across ranks and with
``hvd.DistributedOptimizer`` trained by hand on the same data in the same order."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.data

import baguahvd.torch as hvd

try:
    import lightning.pytorch as pl

    from baguahvd.lightning import BaguaHvdStrategy
    from tests.support.lightning_models import (
        BATCH,
        CLIP,
        EPOCHS,
        GAMMA,
        LR,
        Classifier,
        CountingCheckpointIO,
        ManualClassifier,
        dataset,
        flat,
        network,
    )
except ModuleNotFoundError as missing:
    if not (missing.name or "").startswith("lightning"):
        raise
    LIGHTNING = False
else:
    LIGHTNING = True

# Skipped test by test rather than as a module, so that the mpirun driver sees tests that ran
# or were skipped, never none.
pytestmark = pytest.mark.skipif(
    not LIGHTNING, reason="needs Lightning (pip install baguahvd[lightning])"
)


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` as the rows of one tensor."""
    return hvd.allgather(tensor.unsqueeze(0))


def trainer(strategy: Any = "baguahvd", **kwargs: Any) -> Any:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": EPOCHS,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(kwargs)
    return pl.Trainer(strategy=strategy, **settings)


def loaders() -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    data = dataset()
    return (
        torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True),
        torch.utils.data.DataLoader(data, batch_size=BATCH),
    )


def shared_directory(tmp_path: pathlib.Path) -> pathlib.Path:
    """Rank 0's ``tmp_path``, on every rank (one host)."""
    return pathlib.Path(hvd.broadcast_object(str(tmp_path), root_rank=0, name="shared_dir"))


def fit(
    strategy: Any = "baguahvd", scheduled: bool = False, **kwargs: Any
) -> tuple[Any, Classifier]:
    model = Classifier(scheduled)
    run = trainer(strategy, **kwargs)
    run.fit(model, *loaders())
    return run, model


def test_registered_name_builds_the_strategy() -> None:
    run = trainer()
    assert isinstance(run.strategy, BaguaHvdStrategy)
    assert run.world_size == hvd.size() and run.global_rank == hvd.rank()
    assert run.is_global_zero == (hvd.rank() == 0)


def test_unknown_algorithm_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known algorithms: .*bytegrad"):
        BaguaHvdStrategy(algorithm="no_such_algorithm")


def train_by_hand(
    seed: int, rank: int, size: int, clip: float | None, passes: int, scheduled: bool
) -> torch.nn.Module:
    """The training Lightning does, with Horovod's DistributedOptimizer and its gradient
    clipping recipe (synchronize, clip, step without synchronizing)."""
    net = network()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
        named_parameters=net.named_parameters(),
        backward_passes_per_step=passes,
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=GAMMA)
    sampler = torch.utils.data.DistributedSampler(
        dataset(), num_replicas=size, rank=rank, shuffle=True, seed=seed
    )
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i % passes == 0:
                optimizer.zero_grad()
            # Lightning divides the loss by the number of accumulated batches.
            (F.cross_entropy(net(x), y) / passes).backward()
            if (i + 1) % passes and i + 1 < len(loader):
                continue
            optimizer.synchronize()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            with optimizer.skip_synchronize():
                optimizer.step()
        if scheduled:
            scheduler.step()
    return net


@pytest.mark.parametrize(
    ("clipped", "passes", "scheduled"),
    [(False, 1, False), (True, 1, False), (False, 2, False), (False, 1, True)],
    ids=["plain", "gradient_clip", "accumulate_2", "lr_scheduler"],
)
def test_fit_matches_distributed_optimizer_on_the_same_data(
    rank: int, size: int, clipped: bool, passes: int, scheduled: bool
) -> None:
    clip = CLIP if clipped else None
    run, model = fit(
        scheduled=scheduled, num_sanity_val_steps=0, limit_val_batches=0,
        gradient_clip_val=clip, accumulate_grad_batches=passes,
    )
    sampler = run.train_dataloader.sampler
    assert isinstance(sampler, torch.utils.data.DistributedSampler)
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle) == (size, rank, True)
    if scheduled:
        (config,) = run.lr_scheduler_configs
        assert config.scheduler.optimizer is run.optimizers[0]
        assert run.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * GAMMA**EPOCHS)

    weights = gathered(flat(model))
    for other in weights[1:]:
        assert torch.equal(other, weights[0])
    net = train_by_hand(sampler.seed, rank, size, clip, passes, scheduled)
    torch.testing.assert_close(flat(model), flat(net))


def test_manual_optimization_matches_distributed_optimizer(rank: int, size: int) -> None:
    model = ManualClassifier()
    run = trainer(num_sanity_val_steps=0, limit_val_batches=0)
    run.fit(model, *loaders())
    net = train_by_hand(run.train_dataloader.sampler.seed, rank, size, None, 1, False)
    torch.testing.assert_close(flat(model), flat(net))


def test_sync_dist_metrics_are_reduced_over_ranks(size: int) -> None:
    model = Classifier()
    run = trainer()
    (metrics,) = run.validate(model, loaders()[1], verbose=False)
    assert metrics["rank_mean"] == pytest.approx((size + 1) / 2)
    assert metrics["rank_max"] == pytest.approx(size)
    # Every rank holds the same reduced values.
    values = gathered(torch.tensor([metrics["val_loss"], metrics["rank_mean"]]))
    for other in values[1:]:
        assert torch.equal(other, values[0])


def test_checkpoints_are_written_once_by_rank_0(tmp_path: pathlib.Path, rank: int) -> None:
    directory = shared_directory(tmp_path) / "checkpoints"
    io = CountingCheckpointIO()
    callback = pl.callbacks.ModelCheckpoint(dirpath=directory, save_top_k=-1)
    _, model = fit(enable_checkpointing=True, callbacks=[callback], plugins=[io])
    counts = gathered(torch.tensor([io.saved]))
    assert counts.flatten().tolist() == [EPOCHS] + [0] * (hvd.size() - 1)
    assert len(list(directory.glob("*.ckpt"))) == EPOCHS
    last = torch.load(sorted(directory.glob("*.ckpt"))[-1], weights_only=False)
    torch.testing.assert_close(last["state_dict"]["net.0.weight"], model.net[0].weight.detach())


def test_bytegrad_ranks_end_identical() -> None:
    _, model = fit(BaguaHvdStrategy(algorithm="bytegrad"))
    weights = gathered(flat(model))
    assert torch.isfinite(weights).all()
    for other in weights[1:]:
        assert torch.equal(other, weights[0])
    assert not torch.equal(weights[0], flat(network()))


def weight_averaging(name: str) -> Any:
    """An algorithm that leaves the ranks apart on one host: low-precision decentralized
    is flat (hierarchical mode averages a node's ranks every step), async starts soon."""
    from baguahvd.algorithms import AsyncModelAverageAlgorithm, LowPrecisionDecentralizedAlgorithm

    if name == "async":
        return AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=2)
    if name == "low_precision_decentralized":
        return LowPrecisionDecentralizedAlgorithm(hierarchical=False)
    return name


@pytest.mark.parametrize("algorithm", ["decentralized", "low_precision_decentralized", "async"])
def test_weight_averaging_ranks_are_averaged_for_validation_and_saving(
    algorithm: str, tmp_path: pathlib.Path, size: int
) -> None:
    directory = shared_directory(tmp_path) / algorithm
    callback = pl.callbacks.ModelCheckpoint(dirpath=directory, save_top_k=-1)
    strategy = BaguaHvdStrategy(algorithm=weight_averaging(algorithm))
    _, model = fit(strategy, enable_checkpointing=True, callbacks=[callback])

    # Training leaves the ranks apart...
    last_train = gathered(model.train_snapshots[-1])
    assert any(not torch.equal(other, last_train[0]) for other in last_train[1:])
    # ...validation (after the sanity check) and the end of fitting see one model.
    for snapshot in model.validation_snapshots:
        every = gathered(snapshot)
        for other in every[1:]:
            assert torch.equal(other, every[0])
    final = gathered(flat(model))
    for other in final[1:]:
        assert torch.equal(other, final[0])
    checkpoints = sorted(directory.glob("*.ckpt"))
    assert len(checkpoints) == EPOCHS
    saved = torch.load(checkpoints[-1], weights_only=False)["state_dict"]
    torch.testing.assert_close(saved["net.2.bias"], model.net[2].bias.detach())
