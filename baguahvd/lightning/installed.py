"""Registers baguahvd's strategies in every installed Lightning package and picks the
classes :mod:`baguahvd.lightning` exports: ``lightning.pytorch``'s when ``lightning`` is
installed, else ``pytorch_lightning``'s (lightning_bagua's order)."""

from __future__ import annotations

from types import ModuleType

from baguahvd.lightning.api import LIGHTNING, PYTORCH_LIGHTNING, installed

_BUILT: list[ModuleType] = []
if installed(LIGHTNING):
    from baguahvd.lightning import pytorch

    _BUILT.append(pytorch)
if installed(PYTORCH_LIGHTNING):
    from baguahvd.lightning import pytorch_lightning

    _BUILT.append(pytorch_lightning)
if not _BUILT:
    raise ModuleNotFoundError(
        "baguahvd.lightning needs Lightning: pip install lightning (or pytorch-lightning), "
        "or pip install baguahvd[lightning].",
        name="lightning",
    )

BaguaHvdEnvironment = _BUILT[0].BaguaHvdEnvironment
DistributedLightningOptimizer = _BUILT[0].DistributedLightningOptimizer
BaguaHvdStrategy = _BUILT[0].BaguaHvdStrategy
BaguaStrategy = _BUILT[0].BaguaStrategy
