"""The parts of one Lightning package that the strategy is built from.

Lightning ships under two names with the same classes: ``lightning`` (``lightning.pytorch``
on ``lightning.fabric``) and ``pytorch_lightning`` (on ``lightning_fabric``). A Trainer of one
accepts only strategies derived from its own package's classes, so the strategy is written
once (:mod:`baguahvd.lightning.strategy`) and built for each installed package from the
:class:`LightningAPI` that :func:`load` reads from it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any

LIGHTNING = "lightning.pytorch"
PYTORCH_LIGHTNING = "pytorch_lightning"
PACKAGES = (LIGHTNING, PYTORCH_LIGHTNING)
"""The Lightning packages, the preferred one (lightning_bagua's choice) first."""
_FABRIC = {LIGHTNING: "lightning.fabric", PYTORCH_LIGHTNING: "lightning_fabric"}


@dataclasses.dataclass(frozen=True)
class LightningAPI:
    """The classes and objects of one Lightning package that the strategy uses."""

    package: str
    """``"lightning.pytorch"`` or ``"pytorch_lightning"``."""
    parallel_strategy: type
    strategy_registry: Any
    cluster_environment: type
    lightning_environment: type
    """Lightning's environment of ranks that ``python train.py`` starts on one machine."""
    subprocess_launcher: type
    """Lightning's ``_SubprocessScriptLauncher``: reruns the script once per extra rank."""
    lightning_optimizer: type
    fitting: Any
    """``TrainerFn.FITTING``."""
    rank_zero_only: Any
    """The package's ``rank_zero_only``, whose ``rank`` decides who prints."""


def installed(package: str) -> bool:
    """Whether ``package`` (one of :data:`PACKAGES`) can be imported."""
    top = package.split(".", 1)[0]
    return importlib.util.find_spec(top) is not None and (
        top == package or importlib.util.find_spec(package) is not None
    )


def load(package: str) -> LightningAPI:
    """Imports what the strategy needs from ``package``.

    Raises:
        ValueError: ``package`` is not one of :data:`PACKAGES`.
        ModuleNotFoundError: the package is not installed.
    """
    if package not in _FABRIC:
        raise ValueError(f"Unknown Lightning package {package!r}; use one of {PACKAGES}.")

    def attribute(module: str, name: str) -> Any:
        return getattr(importlib.import_module(module), name)

    fabric = _FABRIC[package]
    return LightningAPI(
        package=package,
        parallel_strategy=attribute(f"{package}.strategies", "ParallelStrategy"),
        strategy_registry=attribute(f"{package}.strategies", "StrategyRegistry"),
        cluster_environment=attribute(f"{fabric}.plugins.environments", "ClusterEnvironment"),
        lightning_environment=attribute(
            f"{fabric}.plugins.environments", "LightningEnvironment"
        ),
        subprocess_launcher=attribute(
            f"{package}.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"
        ),
        lightning_optimizer=attribute(f"{package}.core.optimizer", "LightningOptimizer"),
        fitting=attribute(f"{package}.trainer.states", "TrainerFn").FITTING,
        rank_zero_only=attribute(f"{package}.utilities.rank_zero", "rank_zero_only"),
    )
