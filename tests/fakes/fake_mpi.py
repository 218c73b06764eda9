"""Stand-ins for the members of one mpi4py communicator, all in this process.

The members share one mailbox: a ``bcast`` from the root leaves its object there, and the
other members' ``bcast`` calls take it. Tests therefore drive the root first, or (members
on threads) give the others time to wait for it.
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


def members(size: int, wait_s: float = 0.0) -> list[FakeComm]:
    """The ``size`` members of one fake communicator, by rank; a member's ``bcast`` waits up
    to ``wait_s`` seconds for the root's."""
    mailbox: dict[str, Any] = {}
    return [FakeComm(rank, size, mailbox, wait_s) for rank in range(size)]
