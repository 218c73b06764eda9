"""``BaguaHvdStrategy``: Lightning's Trainer on baguahvd, ``Trainer(strategy="baguahvd")``.

The protocol, in the order Lightning drives it:

1. Construction (``Trainer(...)``): ``set_world_ranks`` runs ``hvd.init()``; ranks and sizes
   come from :class:`~baguahvd.lightning.environment.BaguaHvdEnvironment`. The processes were
   started by ``baguahvdrun`` or ``mpirun``, so there is no launcher.
2. ``setup`` (fit): the model moves to its device, rank 0's weights are broadcast, each
   optimizer is wrapped by ``hvd.DistributedOptimizer`` (Horovod's allreduce, or the Bagua
   algorithm given as ``algorithm=``), learning-rate schedulers are pointed at the wrapped
   optimizers and rank 0's optimizer state is broadcast. Lightning's wrappers of them
   (``self.optimizers()``) are :class:`DistributedLightningOptimizer`.
3. ``optimizer_step``: Lightning runs forward and backward inside the closure it hands to
   ``optimizer.step``. The closure is extended to ``synchronize()`` the optimizer right after
   backward, and the step runs under ``skip_synchronize()``, so that gradient clipping and
   ``on_before_optimizer_step`` see averaged gradients (Horovod's rule: synchronize, clip,
   step without synchronizing).
4. Weight-averaging algorithms (decentralized, low-precision decentralized, async) leave each
   rank with a model of its own. Before validation, before a checkpoint's state is taken and
   when fitting ends, the ranks' parameters and floating-point buffers are replaced by their
   average (async averaging is aborted first and resumed at the next training batch), so
   validation, checkpoints and the fitted model are the same on every rank.
5. Checkpoints are written by rank 0 only (Lightning's ``save_checkpoint``); barrier,
   broadcast, all_gather and ``self.log(..., sync_dist=True)`` go through baguahvd.
6. ``teardown`` closes the algorithms (their threads and communicators); baguahvd itself stays
   initialised, so a process can fit again or keep using ``hvd``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

import baguahvd.torch as hvd
from baguahvd.lightning.environment import BaguaHvdEnvironment
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
_AVERAGE_NAME = "baguahvd.lightning.average_weights"


def reduce_op_of(reduce_op: Optional[Union[ReduceOp, str]]) -> int:
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


def _forward_to_optimizer(name: str) -> Callable[..., Any]:
    def forward(self: LightningOptimizer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.optimizer, name)(*args, **kwargs)

    forward.__name__ = name
    return forward


class DistributedLightningOptimizer(LightningOptimizer):
    """Lightning's wrapper of a ``DistributedOptimizer`` (what ``self.optimizers()`` returns).

    ``LightningOptimizer`` turns its own class into a subclass of the optimizer's class, so
    that ``isinstance`` checks hold; the methods of the class ``DistributedOptimizer``
    builds would then write the protocol's state onto the wrapper. Every
    method the distributed class defines and Lightning's wrapper does not (``zero_grad``,
    ``synchronize``, ``skip_synchronize``, ``load_state_dict``, ...) is therefore called on
    the optimizer itself; ``step`` stays Lightning's, which reaches the strategy.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        forwarded = {
            name: _forward_to_optimizer(name)
            for name, value in vars(type(optimizer)).items()
            if callable(value)
            and not name.startswith("__")
            and not hasattr(LightningOptimizer, name)
        }
        self.__class__ = type(self.__class__.__name__, (self.__class__,), forwarded)


class BaguaHvdStrategy(ParallelStrategy):
    """Data-parallel training on ranks started by ``baguahvdrun`` or ``mpirun``.

    ``Trainer(strategy="baguahvd")`` (after ``import baguahvd.lightning``, which registers the
    name) or ``Trainer(strategy=BaguaHvdStrategy(algorithm="bytegrad"))``. Every process runs
    the same script and builds its own Trainer; Lightning starts no process. Scale the
    learning rate by ``hvd.size()`` yourself, as with Horovod.

    Args:
        algorithm: a Bagua algorithm, as ``hvd.DistributedOptimizer(..., algorithm=...)``
            takes it: a registered name such as ``"bytegrad"`` or ``"decentralized"``, or an
            algorithm object carrying hyperparameters. None (default): the
            ``BAGUAHVD_ALGORITHM`` setting, else Horovod's per-gradient allreduce.
        accelerator: Lightning's accelerator (default: chosen by the Trainer, CPU or CUDA).
        parallel_devices: the devices Lightning sees on this node (default: the Trainer's).
        cluster_environment: default :class:`BaguaHvdEnvironment`, ranks from ``hvd``.
        checkpoint_io: how checkpoints are written (default: Lightning's ``torch.save``).
        precision_plugin: Lightning's precision plugin (default: the Trainer's).

    Raises:
        ValueError: an unknown algorithm name (the message lists the known ones).
    """

    strategy_name = "baguahvd"

    def __init__(
        self,
        algorithm: Union[str, Algorithm, None] = None,
        *,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        self._distributed: list[torch.optim.Optimizer] = []
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment or BaguaHvdEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.algorithm: Optional[Algorithm] = None if algorithm is None else resolve(algorithm)

    # -- ranks and devices -----------------------------------------------------------------

    def set_world_ranks(self) -> None:
        """Initialises baguahvd and makes Lightning's ``rank_zero_only`` output rank 0's."""
        hvd.init()
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @property
    def is_distributed(self) -> bool:
        """Tells the Trainer to give each rank its shard of the data."""
        return True

    @property
    def root_device(self) -> torch.device:
        """``cuda:<local rank>`` with the CUDA accelerator, else the CPU."""
        devices = self.parallel_devices or []
        if devices and devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        self.set_world_ranks()
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- optimizers --------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Lightning's setup, then (when fitting) rank 0's weights and optimizer state on every
        rank and each optimizer wrapped by ``hvd.DistributedOptimizer``."""
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.model is not None
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        wrapped = {
            id(opt): self._distribute(opt, trainer.accumulate_grad_batches)
            for opt in self.optimizers
        }
        self._distributed = [wrapped[id(opt)] for opt in self.optimizers]
        self.optimizers = list(self._distributed)
        # The schedulers were built on the user's optimizers; the wrapped ones share their
        # param_groups, and a scheduler's state_dict and step checks need the one that steps.
        for config in self.lr_scheduler_configs:
            scheduler_optimizer = getattr(config.scheduler, "optimizer", None)
            if id(scheduler_optimizer) in wrapped:
                config.scheduler.optimizer = wrapped[id(scheduler_optimizer)]
                track_steps_for_scheduler(config.scheduler.optimizer)
        for opt in self.optimizers:
            hvd.broadcast_optimizer_state(opt, root_rank=0)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers
        self._lightning_optimizers = [
            (
                DistributedLightningOptimizer
                if opt in self._distributed
                else LightningOptimizer
            )._to_lightning_optimizer(opt, self)
            for opt in optimizers
        ]

    def _distribute(self, optimizer: torch.optim.Optimizer, passes: int) -> torch.optim.Optimizer:
        assert self.lightning_module is not None
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [
            (name, p) for name, p in self.lightning_module.named_parameters() if id(p) in held
        ]
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=named,
            backward_passes_per_step=passes,
            algorithm=self.algorithm,
        )

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Runs Lightning's closure (forward, backward), synchronizes the gradients, then lets
        the precision plugin clip and step without synchronizing again."""
        if optimizer not in self._distributed:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        distributed: Any = optimizer

        def closure_then_synchronize() -> Any:
            result = closure()
            distributed.synchronize()
            return result

        with distributed.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    # -- weight-averaging algorithms ---------------------------------------------------------

    def average_weights(self) -> None:
        """Replaces every rank's parameters and floating-point buffers by their average when
        a weight-averaging algorithm trains the model; does nothing otherwise. Collective."""
        module = self.lightning_module
        if module is None or not any(averages_weights(opt) for opt in self._distributed):
            return
        self._pause_async()
        tensors = [t.detach() for t in (*module.parameters(), *module.buffers())]
        tensors = [t for t in tensors if t.is_floating_point()]
        with torch.no_grad():
            hvd.grouped_allreduce_(tensors, name=_AVERAGE_NAME, op=hvd.Average)

    def _pause_async(self) -> None:
        for opt in self._distributed:
            impl = getattr(opt, "algorithm_impl", None)
            if impl is not None and isinstance(getattr(opt, "algorithm", None),
                                               AsyncModelAverageAlgorithm):
                impl.abort()

    def _resume_async(self) -> None:
        # resume() does nothing unless abort() stopped the averaging.
        for opt in self._distributed:
            impl = getattr(opt, "algorithm_impl", None)
            if impl is not None and isinstance(getattr(opt, "algorithm", None),
                                               AsyncModelAverageAlgorithm):
                impl.resume()

    def on_validation_start(self) -> None:
        self.average_weights()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._resume_async()

    def on_train_end(self) -> None:
        self.average_weights()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state, averaged over the ranks first (see :meth:`average_weights`);
        Lightning calls this on every rank when it takes a checkpoint."""
        self.average_weights()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
        self._pause_async()
        return super().optimizer_state(optimizer)

    # -- collectives ---------------------------------------------------------------------------

    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        """Reduces ``tensor`` over all ranks (``self.log(..., sync_dist=True)`` comes here);
        a non-tensor is returned unchanged.

        Raises:
            ValueError: a process ``group`` (use baguahvd's process sets directly), or an
                unsupported ``reduce_op``.
        """
        if group is not None:
            raise ValueError("BaguaHvdStrategy reduces over all ranks; group must be None.")
        if not isinstance(tensor, Tensor):
            return tensor
        op = reduce_op_of(reduce_op)
        if op == hvd.Average and not tensor.is_floating_point():
            tensor = tensor.float()
        return hvd.allreduce(tensor, op=op)

    def barrier(self, name: Optional[str] = None) -> None:
        hvd.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    def all_gather(
        self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False
    ) -> Tensor:
        """Stacks every rank's ``tensor`` (same shape on each) along a new first dimension;
        differentiable with ``sync_grads=True``."""
        if group is not None:
            raise ValueError("BaguaHvdStrategy gathers over all ranks; group must be None.")
        gathered = hvd.allgather(tensor.unsqueeze(0))
        return gathered if sync_grads else gathered.detach()

    # -- end -------------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Stops the algorithms' threads and frees their communicators; baguahvd stays
        initialised."""
        for opt in self._distributed:
            close = getattr(opt, "close", None)
            if callable(close):
                close()
        self._distributed = []
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="baguahvd: Horovod's allreduce or a Bagua algorithm (algorithm=...)",
            override=True,
        )


BaguaHvdStrategy.register_strategies(StrategyRegistry)
