"""Process sets: subsets of the ranks that run collectives among themselves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _looks_like_communicator(obj: object) -> bool:
    # Checked by shape so that importing baguahvd does not initialise MPI.
    return type(obj).__module__.startswith("mpi4py") and hasattr(obj, "Get_group")


class ProcessSet:
    """A set of ranks, given as a list of global ranks or an mpi4py communicator.

    ``process_set_id`` is ``None`` until the set is registered, either by
    ``hvd.init(process_sets=[...])`` or by ``hvd.add_process_set(...)``.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: Any = None
        self.ranks: list[int] | None
        if _looks_like_communicator(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            self.ranks = None
            return
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            ranks = None
        if ranks is None or not all(isinstance(r, int) and not isinstance(r, bool)
                                    for r in ranks):
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks or an mpi4py "
                "Comm object"
            )
        self.ranks = sorted(ranks)

    def _registered(self) -> bool:
        from baguahvd.common.basics import runtime

        return runtime.is_initialized() and self.process_set_id is not None and (
            runtime.engine is not None and self.process_set_id in runtime.engine.process_sets
        )

    def size(self) -> int | None:
        """Number of ranks in the set, or None before init/registration."""
        if not self._registered():
            return None
        assert self.ranks is not None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set, or None before init/registration.

        Raises:
            ValueError: this process is not a member.
        """
        if not self._registered():
            return None
        from baguahvd.common.basics import runtime

        assert self.ranks is not None
        if runtime.rank() not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(runtime.rank())

    def included(self) -> bool | None:
        """Whether this process belongs to the set, or None before init/registration."""
        if not self._registered():
            return None
        from baguahvd.common.basics import runtime

        assert self.ranks is not None
        return runtime.rank() in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
            f"mpi_comm={self.mpi_comm})"
        )

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
