"""The Lightning strategy's decisions that need no Lightning: how the ranks are started,
whether the Trainer's devices fit the launch, reduce ops, Bagua's algorithm arguments and
the weight-averaging algorithms. Testable in one process without either Lightning package.
"""

from __future__ import annotations

import enum
import functools
import inspect
import weakref
from typing import Any, Optional

import torch

import baguahvd.torch as hvd
from baguahvd.common.config import launcher_rank
from baguahvd.torch.algorithms import (
    Algorithm,
    AsyncModelAverageAlgorithm,
    DecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithm,
    resolve,
)

WEIGHT_AVERAGING: tuple[type[Algorithm], ...] = (
    DecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithm,
    AsyncModelAverageAlgorithm,
)
"""Algorithms after whose steps every rank holds a model of its own."""

_REDUCE_OPS: dict[str, int] = {
    "mean": hvd.Average,
    "avg": hvd.Average,
    "sum": hvd.Sum,
    "max": hvd.Max,
    "min": hvd.Min,
    "product": hvd.Product,
}


class Launch(enum.Enum):
    """Who starts the ranks of a Trainer with this strategy."""

    EXTERNAL = "external"
    """baguahvdrun, mpirun, torchrun or Slurm started every rank; each runs the script and
    builds its own Trainer, and ranks and sizes come from baguahvd."""
    LIGHTNING = "lightning"
    """``python train.py``: Lightning's subprocess launcher starts the other ranks of this
    machine (``Trainer(devices=N)``); its children see ``LOCAL_RANK``."""


def launch_kind() -> Launch:
    """:attr:`Launch.EXTERNAL` when a launcher's rank variable is set (Open MPI, PMIx, PMI,
    Horovod's, torchrun's ``RANK`` or Slurm's ``SLURM_PROCID``), else :attr:`Launch.LIGHTNING`
    (also in the processes Lightning's launcher starts, which have ``LOCAL_RANK`` only)."""
    return Launch.EXTERNAL if launcher_rank() is not None else Launch.LIGHTNING


class LaunchMismatchError(ValueError):
    """The Trainer's ``devices``/``num_nodes`` contradict the job the launcher started, or
    baguahvd was initialised as a different job than the Trainer's."""


def check_devices(
    devices: int, num_nodes: int, local_size: int, cross_size: int, size: int
) -> None:
    """Checks the Trainer's ``devices`` and ``num_nodes`` against an external launch.

    ``devices`` is either 1 (each rank's Trainer drives its own device) or the number of
    ranks the launcher started on each machine (Lightning's meaning); ``num_nodes`` is 1 or
    the number of machines.

    Raises:
        LaunchMismatchError: naming both values and what to change.
    """
    if devices not in (1, local_size):
        raise LaunchMismatchError(
            f"Trainer(devices={devices}) does not match the launch: the launcher started "
            f"{local_size} rank(s) per machine ({size} in all). Use devices=1 or "
            f"devices={local_size}, or launch {devices} ranks per machine."
        )
    if num_nodes not in (1, cross_size):
        raise LaunchMismatchError(
            f"Trainer(num_nodes={num_nodes}) does not match the launch: the launcher started "
            f"ranks on {cross_size} machine(s). Use num_nodes=1 or num_nodes={cross_size}."
        )


def check_initialised_size(world_size: int) -> None:
    """Checks that baguahvd, when already initialised, runs the Trainer's job.

    Raises:
        LaunchMismatchError: ``hvd.init()`` ran before the Trainer started its ranks.
    """
    if hvd.is_initialized() and hvd.size() != world_size:
        raise LaunchMismatchError(
            f"baguahvd was initialised as a job of {hvd.size()} rank(s), but the Trainer "
            f"runs {world_size}. When `python train.py` starts the ranks (Trainer(devices="
            f"{world_size})), call hvd.init() only after trainer.fit() has begun (for example "
            "in configure_optimizers), or start the job with baguahvdrun, mpirun or torchrun."
        )


def torchrun_variables(
    rank: int, size: int, local_rank: int, local_size: int, node_rank: int,
    address: str, port: int,
) -> dict[str, str]:
    """The variables torchrun gives a rank; with them ``hvd.init()`` meets the other ranks
    on gloo through a TCP store at ``address:port`` that rank 0 opens."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": address,
        "MASTER_PORT": str(port),
    }


def reduce_op_of(reduce_op: Optional[Any]) -> int:
    """baguahvd's op for Lightning's ``reduce_op``: a name (``"mean"``, ``"sum"``, ...) or a
    ``torch.distributed.ReduceOp``; None means the mean."""
    if reduce_op is None:
        return hvd.Average
    # torch.distributed.ReduceOp.SUM prints as "RedOpType.SUM" (or "ReduceOp.SUM").
    key = reduce_op if isinstance(reduce_op, str) else str(reduce_op).rsplit(".", 1)[-1]
    op = _REDUCE_OPS.get(key.lower())
    if op is None:
        raise ValueError(
            f"reduce_op {reduce_op!r} is not supported by BaguaHvdStrategy; "
            f"use one of {', '.join(sorted(_REDUCE_OPS))}."
        )
    return op


def bagua_algorithm(name: str, options: dict[str, Any]) -> Algorithm:
    """The algorithm that lightning_bagua's ``BaguaStrategy(algorithm=name, **options)``
    asks for: the registered algorithm ``name`` built with Bagua's keyword arguments
    (``hierarchical``, ``average``, ``peer_selection_mode``, ``communication_interval``,
    ``sync_interval_ms``, ``warmup_steps``, ``q_adam_optimizer``).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        TypeError: an argument the algorithm does not take (the message lists those it does).
    """
    algorithm = resolve(name)
    if not options:
        return algorithm
    kind = type(algorithm)
    accepted = [p for p in inspect.signature(kind).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"algorithm {name!r} does not take {', '.join(unknown)}; it takes "
            f"{', '.join(accepted) or 'no arguments'}."
        )
    return kind(**options)


def averages_weights(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` runs an algorithm that leaves the ranks' models apart."""
    return isinstance(getattr(optimizer, "algorithm", None), WEIGHT_AVERAGING)


def track_steps_for_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """Lets a learning-rate scheduler moved onto ``optimizer`` see its steps.

    torch's schedulers wrap the ``step`` of the optimizer they are built with so that it sets
    ``_opt_called``, and warn on their first ``step()`` when that wrapper (marked
    ``_wrapped_by_lr_sched``) is missing or never ran. The wrapped optimizer gets the same
    marks, or every fit with a scheduler would warn that ``optimizer.step()`` was overridden.
    """
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        return
    owner = weakref.ref(optimizer)
    step = type(optimizer).step

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        instance = owner()
        assert instance is not None, "step() of a freed optimizer"
        instance._opt_called = True  # type: ignore[attr-defined]
        return step(instance, *args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]
