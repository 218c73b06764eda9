"""Process sets: subsets of the ranks that run collectives among themselves.

A :class:`ProcessSet` is a value the user builds before or after ``init()``. The runtime
binds it to itself when it registers the set (at ``init(process_sets=...)``,
``add_process_set`` or for baguahvd's own hierarchical sets); the set then answers its
size and this process's rank by asking that registry whether its id is still known.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Registry(Protocol):
    """What a registered process set asks the runtime that registered it."""

    def is_registered(self, process_set_id: int) -> bool:
        """Whether the running engine knows ``process_set_id``."""
        ...

    def rank(self) -> int:
        """This process's rank in the job."""
        ...


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
        self._registry: Registry | None = None
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

    def bind(self, process_set_id: int, registry: Registry) -> None:
        """Records that ``registry`` registered this set under ``process_set_id``."""
        self.process_set_id = process_set_id
        self._registry = registry

    def unbind(self) -> None:
        """Forgets the registration (the set was removed)."""
        self.process_set_id = None

    def _registered(self) -> bool:
        return (
            self._registry is not None
            and self.process_set_id is not None
            and self._registry.is_registered(self.process_set_id)
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
        assert self.ranks is not None and self._registry is not None
        rank = self._registry.rank()
        if rank not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(rank)

    def included(self) -> bool | None:
        """Whether this process belongs to the set, or None before init/registration."""
        if not self._registered():
            return None
        assert self.ranks is not None and self._registry is not None
        return self._registry.rank() in self.ranks

    def __str__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
            f"mpi_comm={self.mpi_comm})"
        )

    __repr__ = __str__


def check_ranks(ranks: Sequence[int], size: int) -> None:
    """Raises ValueError unless ``ranks`` are distinct ranks of a job of ``size`` ranks."""
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"Process set ranks {bad} are outside the job's ranks 0..{size - 1}.")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"Process set ranks {sorted(ranks)} contain duplicates.")


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
