"""The Lightning cluster environment of ranks that a launcher started (baguahvdrun, mpirun,
torchrun, Slurm).

The processes exist before the Trainer does, so Lightning launches nothing: ranks, sizes
and the node index come from baguahvd after ``hvd.init()``, and the rendezvous address
Lightning asks every environment for is never used (baguahvd connects the ranks itself).

:class:`BaguaHvdEnvironmentMixin` holds the methods; :func:`baguahvd.lightning.strategy.build`
joins it with each installed Lightning package's ``ClusterEnvironment`` (import the result
as ``baguahvd.lightning.pytorch.BaguaHvdEnvironment`` for ``lightning.pytorch`` or
``baguahvd.lightning.pytorch_lightning.BaguaHvdEnvironment`` for ``pytorch_lightning``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import baguahvd.torch as hvd
from baguahvd.lightning.rules import check_devices

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments import ClusterEnvironment as _Base
else:
    _Base = object


class BaguaHvdEnvironmentMixin(_Base):
    """Ranks started by a launcher; every query calls ``hvd.init()`` first, which does
    nothing once baguahvd is initialised."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        # Unused: no torch.distributed process group is created.
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        """Always usable: ``hvd.init()`` also runs as a single process without a launcher."""
        return True

    def world_size(self) -> int:
        hvd.init()
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        # The launcher fixed the size; Lightning's own count of devices does not change it.
        del size

    def global_rank(self) -> int:
        hvd.init()
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        del rank

    def local_rank(self) -> int:
        hvd.init()
        return hvd.local_rank()

    def node_rank(self) -> int:
        hvd.init()
        return hvd.cross_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """``devices`` is 1 or the launcher's ranks per machine; ``num_nodes`` 1 or its
        number of machines.

        Raises:
            LaunchMismatchError: otherwise (see :func:`~baguahvd.lightning.rules.check_devices`).
        """
        hvd.init()
        check_devices(num_devices, num_nodes, hvd.local_size(), hvd.cross_size(), hvd.size())
