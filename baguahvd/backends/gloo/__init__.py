"""gloo through torch.distributed: data plane, control plane, topology and the job's store,
for ranks started by torchrun, ``baguahvdrun --gloo`` or ``horovodrun --gloo`` (no MPI), and
gloo's data plane beside MPI's control plane (:mod:`~baguahvd.backends.gloo.split`).

The process groups are made on the job's store directly, never through
``torch.distributed.init_process_group``, so torch's default group stays the user's.
"""

from __future__ import annotations

from baguahvd.backends.base import Communicator
from baguahvd.backends.gloo.communicator import GlooCommunicator, PendingWork
from baguahvd.backends.gloo.control import GlooControlPlane
from baguahvd.backends.gloo.rendezvous import HTTPRendezvous
from baguahvd.backends.gloo.setup import GlooWorld, connect_store
from baguahvd.backends.gloo.split import (
    SplitControlPlane,
    TwinnedCommunicator,
    connect_store_over,
    twin_of,
)
from baguahvd.backends.gloo.topology import Topology

__all__ = [
    "GlooCommunicator",
    "GlooControlPlane",
    "GlooWorld",
    "HTTPRendezvous",
    "PendingWork",
    "SplitControlPlane",
    "Topology",
    "TwinnedCommunicator",
    "connect_store",
    "connect_store_over",
    "device_communicator",
    "twin_of",
]


def device_communicator(comm: Communicator) -> Communicator:
    """The :data:`~baguahvd.backends.base.DeviceCommFactory` of gloo jobs: gloo moves CUDA
    tensors itself (through host memory), so a process set's device communicator is its
    data communicator."""
    return comm
