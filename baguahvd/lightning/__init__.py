"""PyTorch Lightning on baguahvd: ``import baguahvd.lightning`` registers
``Trainer(strategy="baguahvd")`` and ``Trainer(strategy="bagua")`` in every installed Lightning
package (``lightning.pytorch``, ``pytorch_lightning``).

The classes here are ``lightning.pytorch``'s when ``lightning`` is installed, else
``pytorch_lightning``'s; :mod:`baguahvd.lightning.pytorch` and
:mod:`baguahvd.lightning.pytorch_lightning` name one package's explicitly.
"""

from baguahvd.lightning.installed import (
    BaguaHvdEnvironment,
    BaguaHvdStrategy,
    BaguaStrategy,
    DistributedLightningOptimizer,
)
from baguahvd.lightning.rules import LaunchMismatchError

__all__ = [
    "BaguaHvdEnvironment",
    "BaguaHvdStrategy",
    "BaguaStrategy",
    "DistributedLightningOptimizer",
    "LaunchMismatchError",
]
