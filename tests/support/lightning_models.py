"""The LightningModule and plugins of the Lightning tests; importing this module needs
Lightning, which the test modules check test by test.

The module-level classes are ``lightning.pytorch``'s; :func:`models_for` builds the same
classes for another Lightning package (``pytorch_lightning``)."""

from __future__ import annotations

import functools
import importlib
import types
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.data

import baguahvd.torch as hvd

SAMPLES = 50  # not a multiple of 3: the sampler pads at -np 3
BATCH = 4
EPOCHS = 2
LR = 0.05
GAMMA = 0.5
CLIP = 0.05


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=generator)
    y = (x[:, :3].sum(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def network() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


@functools.cache
def models_for(package: str) -> types.SimpleNamespace:
    """``Classifier``, ``ManualClassifier`` and ``CountingCheckpointIO`` built on the Lightning
    package ``package`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``)."""
    pl = importlib.import_module(package)

    class Classifier(pl.LightningModule):
        def __init__(self, scheduled: bool = False) -> None:
            super().__init__()
            self.net = network()
            self.scheduled = scheduled
            self.train_snapshots: list[torch.Tensor] = []
            self.validation_snapshots: list[torch.Tensor] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.train_snapshots.append(flat(self))

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.validation_snapshots.append(flat(self))
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)
            rank_value = torch.tensor(float(hvd.rank() + 1))
            self.log("rank_mean", rank_value, sync_dist=True)
            self.log("rank_max", rank_value, sync_dist=True, reduce_fx="max")

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
            if not self.scheduled:
                return optimizer
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=GAMMA)]


    class ManualClassifier(Classifier):
        """The same training with manual optimization: the strategy's step path without
        Lightning's closure."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            optimizer = self.optimizers()
            x, y = batch
            optimizer.zero_grad()
            loss = F.cross_entropy(self.net(x), y)
            self.manual_backward(loss)
            optimizer.step()
            return loss.detach()


    class CountingCheckpointIO(pl.plugins.TorchCheckpointIO):
        def __init__(self) -> None:
            super().__init__()
            self.saved = 0

        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            self.saved += 1
            super().save_checkpoint(checkpoint, path, storage_options)

    return types.SimpleNamespace(
        Classifier=Classifier,
        ManualClassifier=ManualClassifier,
        CountingCheckpointIO=CountingCheckpointIO,
    )


_LIGHTNING = models_for("lightning.pytorch")
Classifier = _LIGHTNING.Classifier
ManualClassifier = _LIGHTNING.ManualClassifier
CountingCheckpointIO = _LIGHTNING.CountingCheckpointIO
