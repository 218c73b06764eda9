"""Bagua's communication algorithms (``baguahvd.algorithms.ByteGradAlgorithm`` and the
others); they live in :mod:`baguahvd.torch.algorithms`."""

from baguahvd.torch.algorithms import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    AsyncModelAverageAlgorithm,
    AutoAlgorithm,
    ByteGradAlgorithm,
    DecentralizedAlgorithm,
    GradientAllReduceAlgorithm,
    LinkFigures,
    LowPrecisionDecentralizedAlgorithm,
    QAdamAlgorithm,
    QAdamOptimizer,
    known_algorithms,
    register,
    resolve,
)

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
