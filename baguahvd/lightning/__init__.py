"""PyTorch Lightning on baguahvd: ``import baguahvd.lightning`` registers
``Trainer(strategy="baguahvd")``; :class:`BaguaHvdStrategy` takes ``algorithm=``."""

from baguahvd.lightning.environment import BaguaHvdEnvironment
from baguahvd.lightning.strategy import BaguaHvdStrategy

__all__ = ["BaguaHvdEnvironment", "BaguaHvdStrategy"]
