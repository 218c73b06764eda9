"""The algorithm names that ``DistributedOptimizer(..., algorithm=...)`` accepts."""

from __future__ import annotations

from collections.abc import Callable

from baguahvd.torch.algorithms.async_model_average import AsyncModelAverageAlgorithm
from baguahvd.torch.algorithms.auto import AutoAlgorithm
from baguahvd.torch.algorithms.base import Algorithm
from baguahvd.torch.algorithms.bytegrad import ByteGradAlgorithm
from baguahvd.torch.algorithms.decentralized import DecentralizedAlgorithm
from baguahvd.torch.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from baguahvd.torch.algorithms.low_precision_decentralized import (
    LowPrecisionDecentralizedAlgorithm,
)
from baguahvd.torch.algorithms.q_adam import QAdamAlgorithm

_REGISTRY: dict[str, Callable[[], Algorithm]] = {
    GradientAllReduceAlgorithm.name: GradientAllReduceAlgorithm,
    ByteGradAlgorithm.name: ByteGradAlgorithm,
    DecentralizedAlgorithm.name: DecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithm.name: LowPrecisionDecentralizedAlgorithm,
    AsyncModelAverageAlgorithm.name: AsyncModelAverageAlgorithm,
    QAdamAlgorithm.name: QAdamAlgorithm,
    AutoAlgorithm.name: AutoAlgorithm,
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
