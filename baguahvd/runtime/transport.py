"""Which transport ``init()`` uses for CPU tensors and negotiation: MPI or gloo.

The launcher decides (:class:`~baguahvd.common.config.Launch`): under mpirun (or srun
--mpi=pmix, MPICH) MPI; started by torchrun, ``baguahvdrun --gloo`` or ``horovodrun
--gloo``, gloo. BAGUAHVD_CPU_BACKEND (or Horovod's HOROVOD_CPU_OPERATIONS /
HOROVOD_CONTROLLER) forces one. A process that no launcher started runs MPI as a job of
one, as Horovod does.

A job must never train alone by mistake: when the launcher's variables say there are
several ranks but the chosen transport found a job of one, :func:`check_joined` raises.
"""

from __future__ import annotations

import enum
from typing import Any

from baguahvd.common.config import Launch


class Transport(enum.Enum):
    MPI = "mpi"
    GLOO = "gloo"


def choose(cpu_backend: str, launch: Launch, comm: Any) -> Transport:
    """The transport of this process.

    Args:
        cpu_backend: ``Config.cpu_backend`` (``auto``, ``mpi`` or ``gloo``).
        launch: what the launcher announced.
        comm: ``init()``'s ``comm`` argument; a communicator or rank list means MPI unless
            gloo is forced (which then rejects it).
    """
    if cpu_backend == "mpi":
        return Transport.MPI
    if cpu_backend == "gloo":
        return Transport.GLOO
    if comm is None and launch.launcher in ("torchrun", "horovodrun-gloo"):
        return Transport.GLOO
    return Transport.MPI


def check_joined(launch: Launch, transport: Transport, size: int) -> None:
    """Raises when the launcher started several ranks but this one found itself alone.

    Raises:
        ValueError: naming the launcher's variables and what to do.
    """
    if launch.size > 1 and size == 1 and launch.launcher in ("torchrun", "horovodrun-gloo"):
        names = ", ".join(launch.variables)
        raise ValueError(
            f"the launcher's variables ({names}) say this job has {launch.size} ranks, but "
            f"{transport.value.upper()} started this process alone (size 1), so it would "
            "train by itself. Leave BAGUAHVD_CPU_BACKEND unset (or set it to gloo) for "
            "torchrun and horovodrun --gloo launches, or start the job with mpirun."
        )
