"""Bagua's communication algorithms behind ``DistributedOptimizer(..., algorithm=...)``.

``algorithm`` is a registered name (``"bytegrad"``) or an :class:`Algorithm` object carrying
hyperparameters (``ByteGradAlgorithm(hierarchical=False)``); ``BAGUAHVD_ALGORITHM`` or
``baguahvdrun --algorithm`` set the default.
"""

from __future__ import annotations

from collections.abc import Callable

from baguahvd.algorithms.async_model_average import AsyncModelAverageAlgorithm
from baguahvd.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl
from baguahvd.algorithms.bytegrad import ByteGradAlgorithm
from baguahvd.algorithms.decentralized import DecentralizedAlgorithm
from baguahvd.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from baguahvd.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
from baguahvd.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

_REGISTRY: dict[str, Callable[[], Algorithm]] = {
    GradientAllReduceAlgorithm.name: GradientAllReduceAlgorithm,
    ByteGradAlgorithm.name: ByteGradAlgorithm,
    DecentralizedAlgorithm.name: DecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithm.name: LowPrecisionDecentralizedAlgorithm,
    AsyncModelAverageAlgorithm.name: AsyncModelAverageAlgorithm,
    QAdamAlgorithm.name: QAdamAlgorithm,
}


def register(name: str, factory: Callable[[], Algorithm]) -> None:
    """Makes ``factory()`` available as ``algorithm=name``."""
    _REGISTRY[name] = factory


def known_algorithms() -> list[str]:
    return sorted(_REGISTRY)


def resolve(algorithm: str | Algorithm) -> Algorithm:
    """An algorithm object for a name or an object; unknown names list the known ones."""
    if isinstance(algorithm, Algorithm):
        return algorithm
    if isinstance(algorithm, str):
        factory = _REGISTRY.get(algorithm.strip().lower())
        if factory is not None:
            return factory()
    raise ValueError(
        f"Unknown algorithm {algorithm!r}; known algorithms: {', '.join(known_algorithms())}."
    )


__all__ = [
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "AsyncModelAverageAlgorithm",
    "ByteGradAlgorithm",
    "DecentralizedAlgorithm",
    "GradientAllReduceAlgorithm",
    "LowPrecisionDecentralizedAlgorithm",
    "QAdamAlgorithm",
    "QAdamOptimizer",
    "known_algorithms",
    "register",
    "resolve",
]
