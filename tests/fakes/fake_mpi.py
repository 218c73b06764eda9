"""Stand-ins for the members of one mpi4py communicator, all in this process.

The members share one mailbox: a ``bcast`` from the root leaves its object there, and the
other members' ``bcast`` calls take it. Tests therefore drive the root first, or (members
on threads) give the others time to wait for it. ``Ibcast`` works the same way on byte
buffers, except that a member's request only completes (``Test``) once the root has posted:
a root that never comes leaves it pending.
"""

from __future__ import annotations

import time
from typing import Any


class FakeComm:
    """One member's view of the communicator (``Get_rank``, ``Get_size``, ``bcast``)."""

    def __init__(self, rank: int, size: int, mailbox: dict[str, Any],
                 wait_s: float = 0.0) -> None:
        self.rank = rank
        self.size = size
        self.mailbox = mailbox
        self.bcasts: list[tuple[Any, int]] = []
        """What this member passed to ``bcast`` and the root it named."""
        self.wait_s = wait_s
        """How long a member's ``bcast`` waits for the root's."""
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
        deadline = time.monotonic() + self.wait_s
        while "bcast" not in self.mailbox and time.monotonic() < deadline:
            time.sleep(0.001)
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


def members(size: int, wait_s: float = 0.0) -> list[FakeComm]:
    """The ``size`` members of one fake communicator, by rank; a member's ``bcast`` waits up
    to ``wait_s`` seconds for the root's."""
    mailbox: dict[str, Any] = {}
    return [FakeComm(rank, size, mailbox, wait_s) for rank in range(size)]
