"""baguahvd's Lightning classes for ``lightning.pytorch`` (``import lightning.pytorch as pl``).

Importing this module registers ``Trainer(strategy="baguahvd")`` and
``Trainer(strategy="bagua")`` in ``lightning.pytorch``'s ``StrategyRegistry``; it needs the
``lightning`` package. :mod:`baguahvd.lightning.pytorch_lightning` has the same classes for
``pytorch_lightning``.
"""

from baguahvd.lightning.api import LIGHTNING, load
from baguahvd.lightning.build import build

_CLASSES = build(load(LIGHTNING), __name__)

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
