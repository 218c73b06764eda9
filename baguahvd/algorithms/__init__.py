"""Bagua's communication algorithms (``baguahvd.algorithms.ByteGradAlgorithm`` and the
others); they live in :mod:`baguahvd.torch.algorithms`, whose names this module re-exports
(one list, there)."""

from baguahvd.torch.algorithms import *  # noqa: F403
from baguahvd.torch.algorithms import __all__  # noqa: F401
