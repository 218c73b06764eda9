"""gloo through torch.distributed: data plane, control plane, topology and the job's store,
for ranks started by torchrun, ``baguahvdrun --gloo`` or ``horovodrun --gloo`` (no MPI), and
gloo's data plane beside MPI's control plane (:mod:`~baguahvd.backends.gloo.split`).

The process groups are made on the job's store directly, never through
``torch.distributed.init_process_group``, so torch's default group stays the user's.
"""

from __future__ import annotations

from baguahvd.backends.base import Communicator
from baguahvd.backends.gloo.communicator import GlooCommunicator, PendingWork, StoreIdChannel
from baguahvd.backends.gloo.control import GlooControlPlane
from baguahvd.backends.gloo.rendezvous import HTTPRendezvous
from baguahvd.backends.gloo.rounds import await_admission
from baguahvd.backends.gloo.setup import GlooWorld, connect_store
from baguahvd.backends.gloo.split import (
    SplitControlPlane,
    TwinnedCommunicator,
    connect_store_over,
    twin_of,
)
from baguahvd.backends.gloo.topology import Topology
from baguahvd.backends.nccl import NCCLCommunicator

__all__ = [
    "GlooCommunicator",
    "GlooControlPlane",
    "GlooWorld",
    "HTTPRendezvous",
    "PendingWork",
    "SplitControlPlane",
    "StoreIdChannel",
    "Topology",
    "TwinnedCommunicator",
    "await_admission",
    "connect_store",
    "connect_store_over",
    "device_communicator",
    "host_staged_communicator",
    "twin_of",
]


def device_communicator(comm: Communicator) -> Communicator:
    """The :data:`~baguahvd.backends.base.DeviceCommFactory` of gloo jobs: an NCCL
    communicator of the members of ``comm`` for CUDA tensors, its unique id carried by the
    job's store (:class:`StoreIdChannel`). A communicator made without a store keeps
    ``comm``."""
    if not isinstance(comm, GlooCommunicator) or comm.store is None:
        return comm
    return NCCLCommunicator(comm.id_channel())


def host_staged_communicator(comm: Communicator) -> Communicator:
    """The device communicator factory of a gloo job told to move CUDA tensors with gloo
    (``HOROVOD_GPU_OPERATIONS=GLOO``): gloo copies them through host memory itself, so a
    process set's device communicator is its data communicator."""
    return comm
