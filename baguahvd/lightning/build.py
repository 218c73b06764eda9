"""Builds the strategy's classes for one Lightning package and registers them."""

from __future__ import annotations

import dataclasses
from typing import Any

from baguahvd.lightning.api import LightningAPI
from baguahvd.lightning.bagua import BaguaStrategyMixin
from baguahvd.lightning.environment import BaguaHvdEnvironmentMixin
from baguahvd.lightning.strategy import BaguaHvdStrategyMixin, DistributedLightningOptimizerMixin


@dataclasses.dataclass(frozen=True)
class StrategyClasses:
    """The classes built for one Lightning package."""

    environment: type
    """``BaguaHvdEnvironment``: the package's ``ClusterEnvironment`` for launched ranks."""
    optimizer: type
    """``DistributedLightningOptimizer``: the package's ``LightningOptimizer``."""
    strategy: type
    """``BaguaHvdStrategy``, registered as ``"baguahvd"``."""
    bagua: type
    """``BaguaStrategy``, registered as ``"bagua"``."""


def build(api: LightningAPI, module: str) -> StrategyClasses:
    """Builds the strategy's classes on ``api``'s base classes and registers the strategies
    in its ``StrategyRegistry`` under ``"baguahvd"`` and ``"bagua"``.

    Args:
        api: the Lightning package (:func:`baguahvd.lightning.api.load`).
        module: the module that will hold the classes (their ``__module__``, for pickling
            and documentation).
    """

    def make(name: str, bases: tuple[type, ...], **namespace: Any) -> type:
        doc = bases[0].__doc__
        return type(name, bases, {"__module__": module, "__qualname__": name,
                                  "__doc__": doc, **namespace})

    environment = make("BaguaHvdEnvironment", (BaguaHvdEnvironmentMixin, api.cluster_environment))
    optimizer = make(
        "DistributedLightningOptimizer",
        (DistributedLightningOptimizerMixin, api.lightning_optimizer),
        _lightning_optimizer=api.lightning_optimizer,
    )
    strategy = make(
        "BaguaHvdStrategy",
        (BaguaHvdStrategyMixin, api.parallel_strategy),
        _api=api,
        _environment_class=environment,
        _optimizer_class=optimizer,
    )
    bagua = make("BaguaStrategy", (BaguaStrategyMixin, strategy))
    for built in (strategy, bagua):
        built.register_strategies(api.strategy_registry)  # type: ignore[attr-defined]
    return StrategyClasses(environment, optimizer, strategy, bagua)
