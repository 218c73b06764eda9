"""Which transport ``init()`` uses for CPU tensors and negotiation: MPI or gloo.

The launcher decides (:class:`~baguahvd.common.config.Launch`): under mpirun (or srun
--mpi=pmix, MPICH) MPI; started by torchrun, ``baguahvdrun --gloo`` or ``horovodrun
--gloo``, gloo. BAGUAHVD_CPU_BACKEND (or Horovod's HOROVOD_CPU_OPERATIONS /
HOROVOD_CONTROLLER) forces one, except gloo under an MPI launcher: mpirun gives gloo no
place to meet, so each rank would train alone; that is an error. A process that no launcher
started runs MPI as a job of one, as Horovod does.

Why ``auto`` keeps MPI under mpirun: measured on shared memory (two ranks on one host),
``hvd.allreduce`` over MPI took 0.23-0.26 ms at 16 KB, 0.37-0.81 ms at 1 MB and 7-21 ms at
16 MB against 3.3-5.0 ms, 3.1-5.3 ms and 23-24 ms over gloo; gloo was ahead only for a single
64 MB tensor (109-125 ms against 129-141 ms), and 256 fused 16 KB tensors took 7-13 ms over
MPI against 17-19 ms (``benchmarks/cpu_backend.py``; README, "CPU transport"). Over TCP
between hosts no measurement of the two under baguahvd exists yet, so the launcher's
choice stands there too.

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
        if launch.launcher == "mpi" and comm is None:
            raise ValueError(
                "BAGUAHVD_CPU_BACKEND (or HOROVOD_CPU_OPERATIONS/HOROVOD_CONTROLLER) asks for "
                f"gloo, but an MPI launcher started this process ({', '.join(launch.variables)}"
                "), which gives gloo no place for the ranks to meet: each would train alone. "
                "Leave the variable unset (or set it to mpi) under mpirun, or launch with "
                "baguahvdrun --gloo, horovodrun --gloo or torchrun."
            )
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
