"""Notices that the engine no longer makes progress because a peer is gone.

Negotiation cycles run every few milliseconds on every rank, idle or not, and each one ends
only once every rank has reached it. A rank that dies stops them all: its peers wait in MPI
and, without help, forever (Open MPI's launcher ends the job when a rank dies abnormally,
other launchers may not). A daemon thread per rank watches the cycle counter; from the
first tick without progress it looks whether the peers on this node are still alive (by pid
and process start time, so a reused pid does not fool it), and after ``peer_timeout_s``
without any progress it gives up on the peers, wherever they run.

A peer found gone is named once the cycles have stood still for a second: a peer that ended
normally is gone too, after the last cycle, while this rank's engine thread may not have
stopped its watchdog yet, and a second is far more than that takes even on a loaded
machine. Where the transport says that a collective of this rank has failed (gloo does, the
moment a peer's connection closes: ``failed``), the job is ending already, so a peer found
gone is named at once.

The same thread also looks for the alarm of a peer that failed in the middle of a cycle
(the engine's ``poll`` callback, every tenth of a second): the engine thread may then be
blocked in a collective that peer will never join, and cannot look itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger("baguahvd.engine")

# A cycle that takes longer than this makes the watchdog look at the peers.
_STUCK_S = 1.0
_INTERVAL_S = 0.1


def process_identity() -> list[int]:
    """``[pid, start time, node key]`` of this process, to be gathered from every rank."""
    pid = os.getpid()
    return [pid, _start_time(pid), _node_key()]


def _node_key() -> int:
    """Equal for processes that see each other's pids: same host, boot and pid namespace."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass
    digest = hashlib.sha256("\0".join(parts).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces; fields after it are plain.
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return ""


def is_gone(pid: int, start_time: int) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` no longer runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    if start_time and _start_time(pid) not in (0, start_time):
        return True  # the pid now belongs to another process
    return _state(pid) in ("Z", "X")


class Watchdog:
    """A daemon thread that calls ``on_failure(rank, reason)`` once when the engine is stuck
    on a dead peer or makes no progress for ``timeout_s`` (0: never gives up).

    Args:
        rank: this process's rank.
        identities: :func:`process_identity` of every rank, by rank.
        progress: returns a number that changes whenever a cycle completes.
        on_failure: told which rank failed (-1 when unknown) and why.
        timeout_s: seconds without progress before giving up on the peers.
        poll: called every tick (the engine's alarm check); None for nothing.
        failed: whether a collective of this rank has failed (see the module docstring);
            None where the transport does not say.
        clock: the time in seconds (tests step their own).
    """

    def __init__(
        self,
        rank: int,
        identities: Sequence[Sequence[int]],
        progress: Callable[[], int],
        on_failure: Callable[[int, str], None],
        timeout_s: float,
        poll: Callable[[], None] | None = None,
        failed: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        mine = identities[rank]
        self._neighbours = [
            (r, int(ident[0]), int(ident[1]))
            for r, ident in enumerate(identities)
            if r != rank and ident[2] == mine[2]
        ]
        self._progress = progress
        self._on_failure = on_failure
        self._timeout_s = timeout_s
        self._poll = poll
        self._failed = failed
        self._clock = clock
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="baguahvd-watchdog", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def _loop(self) -> None:
        last = self._progress()
        since = self._clock()
        # When each neighbour was first seen gone while the cycles stood still. Looking
        # from the first tick without progress, not only after _STUCK_S, lets the report
        # name the rank that died first rather than one that ended because of it.
        gone_since: dict[int, tuple[float, int]] = {}
        while not self._stopping.wait(_INTERVAL_S):
            if self._poll is not None:
                try:
                    self._poll()
                except Exception:  # noqa: BLE001 - a daemon thread has nobody to raise to
                    logger.exception("the engine watchdog failed to look for alarms")
                    self._poll = None
            count = self._progress()
            now = self._clock()
            if count != last:
                last, since = count, now
                gone_since.clear()
                continue
            for rank, pid, start_time in self._neighbours:
                if rank not in gone_since and is_gone(pid, start_time):
                    gone_since[rank] = (now, pid)
            stuck = now - since
            failed = self._failed is not None and bool(gone_since) and self._failed()
            if stuck < _STUCK_S and not failed:
                continue
            if gone_since:
                rank = min(gone_since, key=lambda r: (gone_since[r][0], r))
                self._report(
                    rank,
                    f"its process (pid {gone_since[rank][1]} on this node) is gone: it was "
                    "killed or crashed without a Python exception",
                )
                return
            if self._timeout_s and stuck >= self._timeout_s:
                self._report(
                    -1,
                    f"no negotiation cycle completed for {stuck:.0f} s "
                    "(BAGUAHVD_PEER_TIMEOUT_SECONDS): a peer died, froze or deadlocked",
                )
                return

    def _report(self, rank: int, reason: str) -> None:
        if self._stopping.is_set():
            return
        try:
            self._on_failure(rank, reason)
        except Exception:  # noqa: BLE001 - a daemon thread has nobody to raise to
            logger.exception("the engine watchdog failed")
