"""Stand-ins for the members of one mpi4py communicator, all in this process.

The members share one mailbox: a ``bcast`` from the root leaves its object there, and the
other members' ``bcast`` calls take it. Tests therefore drive the root first. ``Ibcast``
works the same way on byte buffers, except that a member's request only completes
(``Test``) once the root has posted: a root that never comes leaves it pending.
"""

from __future__ import annotations

from typing import Any


class FakeComm:
    """One member's view of the communicator (``Get_rank``, ``Get_size``, ``bcast``)."""

    def __init__(self, rank: int, size: int, mailbox: dict[str, Any]) -> None:
        self.rank = rank
        self.size = size
        self.mailbox = mailbox
        self.bcasts: list[tuple[Any, int]] = []
        """What this member passed to ``bcast`` and the root it named."""
        self.ibcasts: list[tuple[bytes, int]] = []
        """The bytes this member's ``Ibcast`` buffer held when called, and the root."""

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self.bcasts.append((obj, root))
        if self.rank == root:
            self.mailbox["bcast"] = obj
            return obj
        assert "bcast" in self.mailbox, "drive the root member first"
        return self.mailbox["bcast"]

    def Ibcast(self, buffer: bytearray, root: int = 0) -> FakeRequest:
        self.ibcasts.append((bytes(buffer), root))
        if self.rank == root:
            self.mailbox["ibcast"] = bytes(buffer)
        return FakeRequest(buffer, self.mailbox)


class FakeRequest:
    """The request of one member's ``Ibcast``: done once the root's bytes are there."""

    def __init__(self, buffer: bytearray, mailbox: dict[str, Any]) -> None:
        self.buffer = buffer
        self.mailbox = mailbox
        self.tests = 0

    def Test(self) -> bool:
        self.tests += 1
        if "ibcast" not in self.mailbox:
            return False
        self.buffer[:] = self.mailbox["ibcast"]
        return True


def members(size: int) -> list[FakeComm]:
    """The ``size`` members of one fake communicator, by rank."""
    mailbox: dict[str, Any] = {}
    return [FakeComm(rank, size, mailbox) for rank in range(size)]
