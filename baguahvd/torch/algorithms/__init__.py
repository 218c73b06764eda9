"""Bagua's communication algorithms behind ``DistributedOptimizer(..., algorithm=...)``.

``algorithm`` is a registered name (``"bytegrad"``) or an :class:`Algorithm` object carrying
hyperparameters (``ByteGradAlgorithm(hierarchical=False)``); ``BAGUAHVD_ALGORITHM`` or
``baguahvdrun --algorithm`` set the default.
"""

from baguahvd.torch.algorithms.async_model_average import AsyncModelAverageAlgorithm
from baguahvd.torch.algorithms.auto import AutoAlgorithm, LinkFigures
from baguahvd.torch.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl
from baguahvd.torch.algorithms.bytegrad import ByteGradAlgorithm
from baguahvd.torch.algorithms.decentralized import DecentralizedAlgorithm
from baguahvd.torch.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from baguahvd.torch.algorithms.low_precision_decentralized import (
    LowPrecisionDecentralizedAlgorithm,
)
from baguahvd.torch.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
from baguahvd.torch.algorithms.registry import known_algorithms, register, resolve

__all__ = [
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "AsyncModelAverageAlgorithm",
    "AutoAlgorithm",
    "ByteGradAlgorithm",
    "DecentralizedAlgorithm",
    "GradientAllReduceAlgorithm",
    "LinkFigures",
    "LowPrecisionDecentralizedAlgorithm",
    "QAdamAlgorithm",
    "QAdamOptimizer",
    "known_algorithms",
    "register",
    "resolve",
]
