"""Which transport ``init()`` uses for CPU tensors and negotiation: MPI, gloo, or both.

The launcher decides where the ranks meet (:class:`~baguahvd.common.config.Launch`): under
mpirun (or srun --mpi=pmix, MPICH) MPI; started by torchrun, ``baguahvdrun --gloo`` or
``horovodrun --gloo``, gloo. A process that no launcher started runs MPI as a job of one, as
Horovod does. In an MPI job the CPU collectives (the data plane: the allreduce of the
gradients) may still run on gloo, beside MPI's negotiation (``Transport.MPI_GLOO``,
:mod:`~baguahvd.backends.gloo.split`): rank 0 opens a TCP store and sends its address to
the others over MPI.

BAGUAHVD_CPU_BACKEND (or Horovod's HOROVOD_CPU_OPERATIONS / HOROVOD_CONTROLLER):

- ``mpi``: MPI for everything;
- ``gloo``: gloo for everything, or, under an MPI launcher, gloo's data plane beside MPI;
- ``auto`` (default): the launcher's transport, and in an MPI job gloo's data plane when
  the job spans more than one host (a node does not hold every rank) and MPI's transport
  is TCP on every host (:func:`mpi_is_tcp_only`: mpirun restricted Open MPI to its TCP BTL,
  or the host has no RDMA or Slingshot device and no fabric PML/MTL was named). The choice
  is logged once by rank 0 (HOROVOD_LOG_LEVEL=info).

Why (measured with ``benchmarks/algorithms.py`` and ``benchmarks/cpu_backend.py``; the
figures are in ``benchmarks/results/data_plane/NOTES.md``):

- one host (shared memory): MPI, which is faster than gloo for every size a training step
  sends, and gives the shorter step.
- two hosts over TCP (``benchmarks/emulated_cluster.sh``, Open MPI with btl_tcp_flags
  send): gloo. Its allreduce runs at the link rate as MPI's does, but MPI's blocking
  collectives busy-poll, at many times gloo's CPU per step, which on small nodes takes the
  cores that backward needs. gloo's pairwise exchanges are the exception (sendrecv and
  alltoall ran at half the link rate), so they stay on MPI even then
  (:class:`~baguahvd.backends.gloo.split.TwinnedCommunicator`), which also shortens
  bytegrad's step against MPI alone.

A job must never train alone by mistake: when the launcher's variables say there are
several ranks but the chosen transport found a job of one, :func:`check_joined` raises.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from typing import Any

from baguahvd.backends.base import ControlPlane
from baguahvd.common.config import Launch


class Transport(enum.Enum):
    MPI = "mpi"
    """MPI for everything."""
    GLOO = "gloo"
    """gloo for everything (no MPI)."""
    MPI_GLOO = "mpi+gloo"
    """MPI launches, meets and negotiates; CPU collectives run on gloo."""


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
        return Transport.MPI_GLOO if launch.launcher == "mpi" else Transport.GLOO
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


FAST_FABRIC_CLASSES = ("/sys/class/infiniband", "/sys/class/cxi")
"""Where Linux lists RDMA devices (InfiniBand, RoCE, iWARP, Omni-Path, AWS EFA) and HPE
Slingshot's: a host with one of these may carry MPI over something faster than TCP."""

_TCP_OR_LOCAL_BTLS = frozenset(("tcp", "self", "vader", "sm", "smcuda"))


def fast_fabric_devices(classes: Sequence[str] = FAST_FABRIC_CLASSES) -> list[str]:
    """The RDMA (or Slingshot) devices of this host, by name."""
    found: list[str] = []
    for path in classes:
        try:
            found += sorted(os.listdir(path))
        except OSError:
            continue
    return found


def mpi_is_tcp_only(devices: Sequence[str], components: Sequence[tuple[str, str]]) -> bool:
    """Whether MPI's traffic between hosts goes over TCP.

    Args:
        devices: :func:`fast_fabric_devices` of this host.
        components: :attr:`Launch.mpi_components`, Open MPI's ``--mca`` choices.

    True when mpirun restricted Open MPI to the TCP BTL (``--mca btl tcp,self``, with the
    ob1 PML or none named), or else when the host has no RDMA device and no fabric PML/MTL
    (``ucx``, ``cm``, an ``mtl``) was asked for.
    """
    chosen = dict(components)
    btls = {part.strip() for part in chosen.get("btl", "").split(",") if part.strip()}
    if btls and not btls - _TCP_OR_LOCAL_BTLS and "^" not in chosen.get("btl", ""):
        if chosen.get("pml", "ob1") == "ob1":
            return True
    if chosen.get("pml") in ("ucx", "cm") or chosen.get("mtl"):
        return False
    return not devices


def auto_transport(spans_hosts: bool, launch: Launch, control: ControlPlane) -> Transport:
    """``BAGUAHVD_CPU_BACKEND=auto`` in an MPI job: gloo's data plane when the job spans
    hosts and MPI's transport is TCP on every host, MPI otherwise (see the module
    docstring for the measurements).

    Collective over ``control`` when the job spans hosts: every rank answers the TCP
    question for its own host and all must agree.
    """
    if not spans_hosts:
        return Transport.MPI
    tcp_only = mpi_is_tcp_only(fast_fabric_devices(), launch.mpi_components)
    answers = control.allgather_ints([int(tcp_only)])
    return Transport.MPI_GLOO if all(a[0] for a in answers) else Transport.MPI
