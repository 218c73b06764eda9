"""``BaguaHvdStrategy``: Lightning's Trainer on baguahvd, ``Trainer(strategy="baguahvd")``,
and ``BaguaStrategy``, lightning_bagua's strategy of the same name (``strategy="bagua"``).

One source for both Lightning packages: :class:`BaguaHvdStrategyMixin` holds the protocol,
and :func:`baguahvd.lightning.build.build` joins it with a package's ``ParallelStrategy``
(``lightning.pytorch`` or ``pytorch_lightning``) and registers the result in that package's
``StrategyRegistry``. :mod:`baguahvd.lightning.pytorch` and
:mod:`baguahvd.lightning.pytorch_lightning` hold the built classes.

The protocol, in the order Lightning drives it:

1. Construction (``Trainer(...)``): who starts the ranks is read from the environment
   (:func:`~baguahvd.lightning.rules.launch_kind`).

   - A launcher (baguahvdrun, mpirun, torchrun, Slurm) started every rank: ``set_world_ranks``
     runs ``hvd.init()``, ranks and sizes come from the ``BaguaHvdEnvironment``, and the
     Trainer's ``devices``/``num_nodes`` are checked against the launch
     (:func:`~baguahvd.lightning.rules.check_devices`). Lightning launches nothing.
   - ``python train.py``: with ``Trainer(devices=N)``, N > 1, Lightning's own subprocess
     launcher and ``LightningEnvironment`` start the other N - 1 ranks of the machine, as for
     DDP. baguahvd is initialised later, in step 2.

2. ``setup_environment`` (inside the launch): the device is selected; ranks that Lightning
   started get torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
   GROUP_RANK, MASTER_ADDR, MASTER_PORT), so ``hvd.init()`` meets the others on gloo through
   the TCP store rank 0 opens at Lightning's address and port, without MPI.
3. ``setup`` (fit): the model moves to its device, rank 0's weights are broadcast, each
   optimizer is wrapped by ``hvd.DistributedOptimizer`` (Horovod's allreduce, or the Bagua
   algorithm given as ``algorithm=``), learning-rate schedulers are pointed at the wrapped
   optimizers and rank 0's optimizer state is broadcast. Lightning's wrappers of them
   (``self.optimizers()``) are ``DistributedLightningOptimizer``.
4. ``optimizer_step``: Lightning runs forward and backward inside the closure it hands to
   ``optimizer.step``. The closure is extended to ``synchronize()`` the optimizer right after
   backward, and the step runs under ``skip_synchronize()``, so that gradient clipping and
   ``on_before_optimizer_step`` see averaged gradients (Horovod's rule: synchronize, clip,
   step without synchronizing).
5. Weight-averaging algorithms (decentralized, low-precision decentralized, async) leave each
   rank with a model of its own. Before validation, before a checkpoint's state is taken and
   when fitting ends, the ranks' parameters and floating-point buffers are replaced by their
   average (async averaging is aborted first and resumed at the next training batch), so
   validation, checkpoints and the fitted model are the same on every rank.
6. Checkpoints are written by rank 0 only (Lightning's ``save_checkpoint``); barrier,
   broadcast, all_gather and ``self.log(..., sync_dist=True)`` go through baguahvd.
7. ``teardown`` closes the algorithms (their threads and communicators); baguahvd itself stays
   initialised, so a process can fit again or keep using ``hvd``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

import baguahvd.torch as hvd
from baguahvd.lightning.api import LightningAPI
from baguahvd.lightning.environment import BaguaHvdEnvironmentMixin
from baguahvd.lightning.rules import (
    Launch,
    averages_weights,
    check_devices,
    check_initialised_size,
    launch_kind,
    reduce_op_of,
    torchrun_variables,
    track_steps_for_scheduler,
)
from baguahvd.torch.algorithms import Algorithm, AsyncModelAverageAlgorithm, resolve

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer as _OptimizerBase
    from lightning.pytorch.strategies import ParallelStrategy as _StrategyBase
else:
    _OptimizerBase = _StrategyBase = object

_AVERAGE_NAME = "baguahvd.lightning.average_weights"


def _forward_to_optimizer(name: str) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.optimizer, name)(*args, **kwargs)

    forward.__name__ = name
    return forward


class DistributedLightningOptimizerMixin(_OptimizerBase):
    """Lightning's wrapper of a ``DistributedOptimizer`` (what ``self.optimizers()`` returns).

    ``LightningOptimizer`` turns its own class into a subclass of the optimizer's class, so
    that ``isinstance`` checks hold; the methods of the class ``DistributedOptimizer``
    builds would then write the protocol's state onto the wrapper. Every
    method the distributed class defines and Lightning's wrapper does not (``zero_grad``,
    ``synchronize``, ``skip_synchronize``, ``load_state_dict``, ...) is therefore called on
    the optimizer itself; ``step`` stays Lightning's, which reaches the strategy.
    """

    _lightning_optimizer: type
    """The package's ``LightningOptimizer`` (set by :func:`~baguahvd.lightning.build.build`)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        forwarded = {
            name: _forward_to_optimizer(name)
            for name, value in vars(type(optimizer)).items()
            if callable(value)
            and not name.startswith("__")
            and not hasattr(self._lightning_optimizer, name)
        }
        self.__class__ = type(self.__class__.__name__, (self.__class__,), forwarded)


class BaguaHvdStrategyMixin(_StrategyBase):
    """Data-parallel training on baguahvd, with Horovod's allreduce or a Bagua algorithm.

    ``Trainer(strategy="baguahvd")`` (after ``import baguahvd.lightning``, which registers the
    name in every installed Lightning package) or
    ``Trainer(strategy=BaguaHvdStrategy(algorithm="bytegrad"))``, with the class of the
    Trainer's package::

        from baguahvd.lightning.pytorch import BaguaHvdStrategy           # lightning.pytorch
        from baguahvd.lightning.pytorch_lightning import BaguaHvdStrategy  # pytorch_lightning

    (``baguahvd.lightning.BaguaHvdStrategy`` is the first of these that is installed.)

    Ranks started by baguahvdrun, mpirun, torchrun or Slurm each build their own Trainer
    with ``devices=1`` or ``devices=<ranks per machine>``; ``python train.py`` with
    ``Trainer(devices=N)`` starts the N ranks itself, as Lightning's DDP does. Scale the
    learning rate by the number of ranks (``trainer.world_size``) yourself, as with Horovod.

    Args:
        algorithm: a Bagua algorithm, as ``hvd.DistributedOptimizer(..., algorithm=...)``
            takes it: a registered name such as ``"bytegrad"`` or ``"decentralized"``, or an
            algorithm object carrying hyperparameters. None (default): the
            ``BAGUAHVD_ALGORITHM`` setting, else Horovod's per-gradient allreduce.
        accelerator: Lightning's accelerator (default: chosen by the Trainer, CPU or CUDA).
        parallel_devices: the devices Lightning sees on this node (default: the Trainer's).
        cluster_environment: default: ``BaguaHvdEnvironment`` (ranks from ``hvd``) when a
            launcher started the process, else Lightning's ``LightningEnvironment``.
        checkpoint_io: how checkpoints are written (default: Lightning's ``torch.save``).
        precision_plugin: Lightning's precision plugin (default: the Trainer's).

    Raises:
        ValueError: an unknown algorithm name (the message lists the known ones).
        LaunchMismatchError: (a ``ValueError``, when the Trainer is built) ``devices`` or
            ``num_nodes`` contradict the launcher's job, or ``hvd.init()`` ran as a job of
            another size before ``python train.py``'s ranks were started.
    """

    strategy_name = "baguahvd"
    _api: LightningAPI
    """The Lightning package this class was built for (set by
    :func:`~baguahvd.lightning.build.build`)."""
    _environment_class: type
    _optimizer_class: type

    def __init__(
        self,
        algorithm: Union[str, Algorithm, None] = None,
        *,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        self.algorithm: Optional[Algorithm] = None if algorithm is None else resolve(algorithm)
        self._distributed: list[torch.optim.Optimizer] = []
        self._num_nodes = 1
        if cluster_environment is None:
            self._launch = launch_kind()
            cluster_environment = (
                self._environment_class()
                if self._launch is Launch.EXTERNAL
                else self._api.lightning_environment()
            )
        else:
            self._launch = (
                Launch.EXTERNAL
                if isinstance(cluster_environment, BaguaHvdEnvironmentMixin)
                else Launch.LIGHTNING
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    # -- ranks and devices -----------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """The ranks per machine that the Trainer was given (its ``devices``)."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    def set_world_ranks(self) -> None:
        """Under a launcher, initialises baguahvd and checks the Trainer's devices against
        the launch; otherwise sets Lightning's ranks from its own count of devices. Either
        way Lightning's ``rank_zero_only`` output becomes rank 0's."""
        environment = self.cluster_environment
        assert environment is not None
        if self._launch is Launch.EXTERNAL:
            hvd.init()
            check_devices(self.num_processes, self.num_nodes, hvd.local_size(),
                          hvd.cross_size(), hvd.size())
        else:
            environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only: Any = self._api.rank_zero_only
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _configure_launcher(self) -> None:
        """Lightning's subprocess launcher when ``python train.py`` runs several ranks."""
        if self._launch is Launch.LIGHTNING and self.num_nodes * self.num_processes > 1:
            self._launcher = self._api.subprocess_launcher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @property
    def is_distributed(self) -> bool:
        """Tells the Trainer to give each rank its shard of the data."""
        return True

    @property
    def root_device(self) -> torch.device:
        """This rank's CUDA device with the CUDA accelerator (``cuda:<local rank>`` when the
        Trainer has one device per rank), else the CPU."""
        devices = self.parallel_devices or []
        if not devices or devices[0].type != "cuda":
            return torch.device("cpu")
        if len(devices) > 1:
            return devices[self.local_rank]
        return torch.device("cuda", self.local_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        """Selects the device, then starts baguahvd: at once under a launcher, through
        torchrun's variables in ranks that ``python train.py`` started."""
        super().setup_environment()
        if self._launch is Launch.EXTERNAL:
            self.set_world_ranks()
            return
        check_initialised_size(self.world_size)
        environment = self.cluster_environment
        assert environment is not None
        if self.world_size > 1 and not hvd.is_initialized():
            os.environ.update(torchrun_variables(
                self.global_rank, self.world_size, self.local_rank, self.num_processes,
                self.node_rank, environment.main_address, environment.main_port,
            ))
        hvd.init()
        check_initialised_size(self.world_size)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- optimizers --------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Lightning's setup, then (when fitting) rank 0's weights and optimizer state on every
        rank and each optimizer wrapped by ``hvd.DistributedOptimizer``."""
        super().setup(trainer)
        if trainer.state.fn != self._api.fitting:
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
        wrappers: tuple[Any, Any] = (self._optimizer_class, self._api.lightning_optimizer)
        self._lightning_optimizers = [
            wrappers[opt not in self._distributed]._to_lightning_optimizer(opt, self)
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
        optimizer: Any,
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

    def _async_impls(self) -> list[Any]:
        return [
            opt.algorithm_impl  # type: ignore[attr-defined]
            for opt in self._distributed
            if getattr(opt, "algorithm_impl", None) is not None
            and isinstance(getattr(opt, "algorithm", None), AsyncModelAverageAlgorithm)
        ]

    def _pause_async(self) -> None:
        for impl in self._async_impls():
            impl.abort()

    def _resume_async(self) -> None:
        # resume() does nothing unless abort() stopped the averaging.
        for impl in self._async_impls():
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

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self._pause_async()
        return super().optimizer_state(optimizer)

    # -- collectives ---------------------------------------------------------------------------

    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Any] = "mean",
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
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="baguahvd: Horovod's allreduce or a Bagua algorithm (algorithm=...)",
            override=True,
        )

