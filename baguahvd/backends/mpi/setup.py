"""Setup helpers for ``init()``: the job's communicator, communicators of rank lists, and
what MPI was started with. Importing this module starts MPI; the thread level must be chosen
first (:func:`baguahvd.backends.prepare_mpi`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from baguahvd.backends.mpi.communicator import MPICommunicator


def world() -> Any:
    """The job's communicator (MPI_COMM_WORLD)."""
    return MPI.COMM_WORLD


def is_communicator(obj: object) -> bool:
    """Whether ``obj`` is an mpi4py communicator."""
    return isinstance(obj, MPI.Comm)


def communicator_from_ranks(ranks: Sequence[int]) -> Any:
    """A communicator of the given world ranks, created by those ranks only."""
    world_comm = MPI.COMM_WORLD
    group = world_comm.Get_group().Incl(list(ranks))
    try:
        return world_comm.Create_group(group, tag=1)
    finally:
        group.Free()


def new_communicator(base: Any, ranks: Sequence[int] | None = None) -> MPICommunicator | None:
    """A new communicator over ``base``: a duplicate of all of it (collective over every
    rank of ``base``) or of its ``ranks`` (collective over those ranks only; ``None`` on the
    others). Nothing else ever communicates on it."""
    if ranks is None or sorted(ranks) == list(range(base.Get_size())):
        return MPICommunicator(base.Dup())
    if base.Get_rank() not in ranks:
        return None
    group = base.Get_group().Incl(sorted(ranks))
    try:
        return MPICommunicator(base.Create_group(group, tag=2))
    finally:
        group.Free()


def world_ranks_of(comm: Any, base: Any) -> list[int]:
    """The ranks in ``base`` of the members of ``comm``, in ``comm`` rank order."""
    translated = MPI.Group.Translate_ranks(
        comm.Get_group(), list(range(comm.Get_size())), base.Get_group()
    )
    return [int(r) for r in translated]


def threads_supported() -> bool:
    """Whether the MPI library runs with MPI_THREAD_MULTIPLE."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def null_communicator() -> Any:
    """MPI_COMM_NULL, what non-members hold for a communicator they are not part of."""
    return MPI.COMM_NULL
