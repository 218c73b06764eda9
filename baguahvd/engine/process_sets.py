"""The engine's process-set registry.

Process sets are registered collectively: every rank registers the same rank lists in the
same order (static sets during ``init()``, dynamic ones as ADD_PROCESS_SET collectives that
every rank runs in the agreed order), so ids agree everywhere. Id 0 is the global set. Only
members hold a data communicator; a set's device communicator is made at its first device
collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from baguahvd.backends.base import Communicator, ControlPlane, SelfCommunicator
from baguahvd.engine.buffers import FusionPool
from baguahvd.engine.messages import GLOBAL_PROCESS_SET_ID


@dataclasses.dataclass
class ProcessSetState:
    """A registered process set as the engine sees it."""

    id: int
    ranks: tuple[int, ...]
    """Global ranks, sorted."""
    comm: Communicator | None
    """Communicator of the members; None on ranks outside the set."""
    device_comm: Communicator | None = None
    """Device (GPU) communicator of the members, created at the set's first GPU collective."""
    device_buffers: FusionPool = dataclasses.field(default_factory=FusionPool)
    """The fusion buffers of the device communicator's units, which use them on that
    communicator's stream only: units of different sets' communicators run at the same time,
    unordered, and a buffer dropped when it grows may be handed out again by the allocator
    of that stream at once."""

    def includes(self, rank: int) -> bool:
        return rank in self.ranks

    @property
    def member(self) -> bool:
        """Whether this rank belongs to the set (only members hold a communicator)."""
        return self.comm is not None

    def set_rank(self, rank: int) -> int:
        return self.ranks.index(rank)


class ProcessSetRegistry:
    """The process sets registered so far, by id (see module docstring)."""

    def __init__(self, rank: int, size: int, control: ControlPlane) -> None:
        self.rank = rank
        self.control = control
        self.states: dict[int, ProcessSetState] = {
            GLOBAL_PROCESS_SET_ID: ProcessSetState(
                GLOBAL_PROCESS_SET_ID,
                tuple(range(size)),
                control.create_group_comm(range(size)) if size > 1 else SelfCommunicator(),
            )
        }
        self._next_id = 1

    def register(self, ranks: Sequence[int]) -> int:
        """Registers a set of ``ranks`` (collective over every rank); returns its id."""
        ranks = tuple(sorted(ranks))
        comm: Communicator | None
        if len(ranks) == 1:
            comm = SelfCommunicator() if ranks[0] == self.rank else None
        else:
            comm = self.control.create_group_comm(ranks)
        ident = self._next_id
        self._next_id += 1
        self.states[ident] = ProcessSetState(ident, ranks, comm)
        return ident

    def remove(self, ident: int) -> None:
        """Forgets set ``ident`` and frees its communicators."""
        state = self.states.pop(ident, None)
        if state is None:
            return
        if state.device_comm is not None:
            state.device_comm.free()
        if state.comm is not None:
            state.comm.free()


def not_member_message(label: str, state: ProcessSetState | None, rank: int) -> str:
    """Horovod's error for a collective on a set that is unknown or lacks this rank."""
    title = label.split("_")[-1].capitalize() if label.startswith("grouped") else (
        label.capitalize()
    )
    if state is None:
        return f"{title}: Process set provided does not exist, or has not been registered."
    return f"{title}: Rank {rank} is not a member of the provided process set."
