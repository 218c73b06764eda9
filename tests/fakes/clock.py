"""A clock the test steps: engine threads' pauses between cycles take no wall-clock time and
are recorded, so tests check the pauses themselves instead of counting cycles in a window
(which fails on a loaded machine)."""

from __future__ import annotations

import dataclasses
import threading
import time

from baguahvd.engine.clock import Clock


@dataclasses.dataclass
class Wait:
    """One wait of one rank: how long it asked for and whether its event ended it."""

    rank: int
    timeout_s: float
    deadline: float
    woken: bool | None = None
    """None while it waits."""


class SteppedClock:
    """Shared virtual time; :meth:`for_rank` gives each rank's engine its view of it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.now = 0.0
        self.waits: list[Wait] = []

    def for_rank(self, rank: int) -> Clock:
        return _RankClock(self, rank)

    def wait_for(self, waiting: int, timeout_s: float = 10.0) -> list[Wait]:
        """Returns once ``waiting`` ranks wait on the clock (at most ``timeout_s`` of real
        time: a bound for a test that went wrong, never a measure)."""
        limit = time.monotonic() + timeout_s
        with self._cond:
            while len(pending := [w for w in self.waits
                                  if w.woken is None and w.deadline > self.now]) < waiting:
                left = limit - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(pending)} of {waiting} ranks wait on the clock")
                self._cond.wait(left)
            return pending

    def step(self, waiting: int, timeout_s: float = 10.0) -> None:
        """Once ``waiting`` ranks wait on the clock (see :meth:`wait_for`), moves time to
        the earliest of their deadlines."""
        pending = self.wait_for(waiting, timeout_s)
        with self._cond:
            self.now = min(w.deadline for w in pending)
            self._cond.notify_all()

    def pauses(self, rank: int, since: int = 0) -> list[float]:
        """What ``rank`` asked to wait, in order, from wait number ``since`` on."""
        with self._cond:
            return [w.timeout_s for w in self.waits[since:] if w.rank == rank]

    def wait(self, rank: int, event: threading.Event, timeout_s: float) -> bool:
        with self._cond:
            record = Wait(rank, timeout_s, self.now + timeout_s)
            self.waits.append(record)
            self._cond.notify_all()
            # A set event does not notify the condition: look again now and then.
            while not event.is_set() and self.now < record.deadline:
                self._cond.wait(0.01)
            record.woken = event.is_set()
            self._cond.notify_all()
            return record.woken


class _RankClock(Clock):
    def __init__(self, clock: SteppedClock, rank: int) -> None:
        self._clock = clock
        self._rank = rank

    def now(self) -> float:
        return self._clock.now

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        return self._clock.wait(self._rank, event, timeout_s)
