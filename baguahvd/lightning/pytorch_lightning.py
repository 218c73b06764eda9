"""baguahvd's Lightning classes for ``pytorch_lightning`` (``import pytorch_lightning as pl``).

Importing this module registers ``Trainer(strategy="baguahvd")`` and
``Trainer(strategy="bagua")`` in ``pytorch_lightning``'s ``StrategyRegistry``; it needs the
``pytorch-lightning`` package. :mod:`baguahvd.lightning.pytorch` has the same classes for
``lightning.pytorch``.
"""

from baguahvd.lightning.api import PYTORCH_LIGHTNING, load
from baguahvd.lightning.build import build

_CLASSES = build(load(PYTORCH_LIGHTNING), __name__)

BaguaHvdEnvironment = _CLASSES.environment
DistributedLightningOptimizer = _CLASSES.optimizer
BaguaHvdStrategy = _CLASSES.strategy
BaguaStrategy = _CLASSES.bagua

__all__ = [
    "BaguaHvdEnvironment",
    "BaguaHvdStrategy",
    "BaguaStrategy",
    "DistributedLightningOptimizer",
]
