"""The engine thread's time: how long it pauses between cycles is read and waited through a
:class:`Clock`, so that tests can give it one they step instead of sleeping."""

from __future__ import annotations

import threading
import time


class Clock:
    """Monotonic seconds, and waiting for an event at most that long: the system's."""

    def now(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        """``event.wait(timeout_s)``: whether the event was set."""
        return event.wait(timeout_s)


SYSTEM_CLOCK = Clock()
"""The clock of every engine not given another one (it holds no state)."""
