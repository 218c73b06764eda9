"""lightning_bagua's ``BaguaStrategy`` on baguahvd: its arguments mapped onto
:class:`~baguahvd.lightning.strategy.BaguaHvdStrategyMixin`, registered as ``"bagua"``."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch

from baguahvd.lightning.rules import bagua_algorithm
from baguahvd.lightning.strategy import BaguaHvdStrategyMixin
from baguahvd.torch.algorithms import Algorithm, resolve


class BaguaStrategyMixin(BaguaHvdStrategyMixin):
    """lightning_bagua's ``BaguaStrategy`` on baguahvd: ``Trainer(strategy="bagua")`` or
    ``Trainer(strategy=BaguaStrategy(algorithm="bytegrad"))``, without Bagua installed.

    Takes lightning_bagua's arguments; the algorithm defaults to ``"gradient_allreduce"``
    and Bagua's keyword arguments configure it. Import it for the Trainer's package::

        from baguahvd.lightning.pytorch import BaguaStrategy           # lightning.pytorch
        from baguahvd.lightning.pytorch_lightning import BaguaStrategy  # pytorch_lightning

    or leave a script's ``from lightning_bagua import BaguaStrategy`` as it is and put
    baguahvd's stand-in for lightning_bagua on the path (``baguahvdrun --as-horovod``, or
    ``PYTHONPATH=$(baguahvdrun --shim-path)``). Everything else is :class:`BaguaHvdStrategy`'s.

    Args:
        algorithm: ``"gradient_allreduce"``, ``"bytegrad"``, ``"decentralized"``,
            ``"low_precision_decentralized"``, ``"qadam"``, ``"async"`` (or any baguahvd
            algorithm name), or an algorithm object.
        flatten: Bagua's choice of flattening the communication buckets; baguahvd
            communicates each bucket as one flat buffer regardless, so ``False`` warns.
        accelerator: as for :class:`BaguaHvdStrategy`.
        parallel_devices: as for :class:`BaguaHvdStrategy`.
        cluster_environment: as for :class:`BaguaHvdStrategy`.
        checkpoint_io: as for :class:`BaguaHvdStrategy`.
        precision_plugin: as for :class:`BaguaHvdStrategy`.
        **bagua_kwargs: the algorithm's keyword arguments, as Bagua's (``hierarchical``,
            ``average``, ``peer_selection_mode``, ``communication_interval``,
            ``sync_interval_ms``, ``warmup_steps``, ``q_adam_optimizer``).

    Raises:
        ValueError: an unknown algorithm name (the message lists the known ones).
        TypeError: a keyword argument the algorithm does not take, or keyword arguments
            with an algorithm object.
    """

    strategy_name = "bagua"

    def __init__(
        self,
        algorithm: Union[str, Algorithm] = "gradient_allreduce",
        flatten: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        **bagua_kwargs: Any,
    ) -> None:
        if isinstance(algorithm, str):
            resolved = bagua_algorithm(algorithm, bagua_kwargs)
        elif bagua_kwargs:
            raise TypeError(
                f"keyword arguments ({', '.join(sorted(bagua_kwargs))}) configure an algorithm "
                "given by name; set them on the algorithm object instead."
            )
        else:
            resolved = resolve(algorithm)
        if not flatten:
            warnings.warn(
                "BaguaStrategy(flatten=False) has no effect: baguahvd communicates each "
                "bucket as one flat buffer.",
                stacklevel=2,
            )
        self.flatten = flatten
        super().__init__(
            resolved,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Bagua's algorithms on baguahvd (lightning_bagua's BaguaStrategy)",
            override=True,
        )
