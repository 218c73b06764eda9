"""The engine's lifecycle: one state, changed only through one transition table.

States (:class:`State`):

- ``IDLE``: running, between cycles. Every rank is at the same point of the protocol, so a
  failure here can still be announced in one more cycle.
- ``NEGOTIATING``: running, inside a cycle: from the bitwise AND that opens it until the
  agreed collectives have run. Ranks are in the middle of the same exchange.
- ``STOPPED``: the job ended normally (a shutdown that every rank agreed on).
- ``FAILED``: the job ended because something failed, and every MPI call of this rank has
  completed: at exit, the ranks meet in a bounded barrier before MPI finalizes.
- ``STUCK``: the job ended because something failed, and some MPI call of this rank may
  never complete (a peer is gone, or left a collective unfinished): leaving ends the job
  with MPI_Abort.
- ``LEAVING``: this rank failed in the middle of a cycle and its engine thread is telling
  the peers with an alarm (see :meth:`Lifecycle.leave_mid_cycle`). Final: ``shutdown()``
  waits for that thread; a later loss of MPI is remembered in :attr:`Lifecycle.stuck_reason`.

Events (:class:`Event`): ``BEGIN_CYCLE``/``END_CYCLE`` (the engine thread), ``STOP`` (an
agreed shutdown), ``FAIL`` (a failure, this rank's or a peer's), ``LOSE_MPI`` (the watchdog
lost a peer, or a peer's alarm arrived) and ``LEAVE`` (this rank leaves the protocol).
``_TRANSITIONS`` lists every (state, event) pair.

The first stop fixes the error every pending and later request raises (:attr:`error`).
Besides the state, the lifecycle holds this rank's announcement of the end of the job (a
:class:`~baguahvd.engine.notices.Notice`), sent to rank 0 in the next cycle.
"""

from __future__ import annotations

import enum
import logging
import sys
import threading
import time

from baguahvd.backends.base import ControlPlane
from baguahvd.common.exceptions import PeerFailureError
from baguahvd.engine.notices import Notice, NoticeKind

logger = logging.getLogger("baguahvd.engine")


class State(enum.Enum):
    IDLE = "idle"
    NEGOTIATING = "negotiating"
    STOPPED = "stopped"
    FAILED = "failed"
    STUCK = "stuck"
    LEAVING = "leaving"


class Event(enum.Enum):
    BEGIN_CYCLE = "begin cycle"
    END_CYCLE = "end cycle"
    STOP = "stop"
    FAIL = "fail"
    LOSE_MPI = "lose MPI"
    LEAVE = "leave"


def _row(
    begin: State, end: State, stop: State, fail: State = State.FAILED
) -> dict[Event, State]:
    """A state's transitions: a lost MPI always leads to ``STUCK`` and leaving to
    ``LEAVING``, whatever the state (both are the worst of their kind)."""
    return {
        Event.BEGIN_CYCLE: begin, Event.END_CYCLE: end, Event.STOP: stop, Event.FAIL: fail,
        Event.LOSE_MPI: State.STUCK, Event.LEAVE: State.LEAVING,
    }


_S = State
_TRANSITIONS: dict[State, dict[Event, State]] = {
    _S.IDLE: _row(begin=_S.NEGOTIATING, end=_S.IDLE, stop=_S.STOPPED),
    _S.NEGOTIATING: _row(begin=_S.NEGOTIATING, end=_S.IDLE, stop=_S.STOPPED),
    # Once stopped, cycles change nothing; a failure or a lost MPI still makes it worse.
    _S.STOPPED: _row(begin=_S.STOPPED, end=_S.STOPPED, stop=_S.STOPPED),
    _S.FAILED: _row(begin=_S.FAILED, end=_S.FAILED, stop=_S.FAILED),
    _S.STUCK: _row(begin=_S.STUCK, end=_S.STUCK, stop=_S.STUCK, fail=_S.STUCK),
    _S.LEAVING: {event: _S.LEAVING for event in Event},
}

RUNNING_STATES = frozenset({State.IDLE, State.NEGOTIATING})
ABNORMAL_STATES = frozenset({State.FAILED, State.STUCK, State.LEAVING})


def transition(state: State, event: Event) -> State:
    """The state that ``event`` leads to from ``state``."""
    return _TRANSITIONS[state][event]


class Lifecycle:
    """Owns the engine's state, its stop error and its announcement; announces, stops,
    raises and hears alarms, and leaves the job (see module docstring).

    Args:
        rank: this process's rank.
        size: number of ranks.
        control: the control plane alarms and the exit barrier go through.
        exit_timeout_s: how long a departing rank waits for its peers
            (BAGUAHVD_EXIT_TIMEOUT_SECONDS).

    It calls nothing above it: whoever stops it (or hears an alarm through it) then fails
    the pending requests with :attr:`error`.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        control: ControlPlane,
        exit_timeout_s: float,
    ) -> None:
        self.rank, self.size, self.control = rank, size, control
        self.exit_timeout_s = exit_timeout_s
        self._lock = threading.Lock()
        self.state = State.IDLE
        self.error: BaseException | None = None
        """The error every pending and later request raises once stopped (first wins)."""
        self.notice: Notice | None = None
        """This rank's announcement of the end of the job, sent in the next cycle."""
        self.stuck_reason: str | None = None
        """Why this rank's MPI calls cannot all complete (``STUCK``, or lost while
        ``LEAVING``)."""
        self.gone: set[int] = set()
        """The ranks whose process is known to be gone (see :meth:`lose_peer`)."""

    def _apply(self, event: Event) -> None:
        self.state = _TRANSITIONS[self.state][event]

    # -- what the rest of the engine asks -------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether requests are still accepted (no stop error yet)."""
        return self.error is None

    def stop_error(self) -> BaseException | None:
        """:attr:`error`, for the parts that ask whether to give up a wait."""
        return self.error

    @property
    def abnormal(self) -> bool:
        """Whether the engine stopped because something failed."""
        return self.state in ABNORMAL_STATES

    @property
    def may_be_stuck(self) -> bool:
        """Whether the engine thread may be blocked in MPI for good: ``shutdown()`` then does
        not wait for it. A FAILED engine's thread has completed its MPI calls and is ending
        its loop, and a thread that is leaving ends in bounded time: both are waited for, so
        that the exit that follows does not mistake a thread still finishing for a stuck
        one."""
        return self.state is State.STUCK

    # -- events -----------------------------------------------------------------------------

    def begin_cycle(self) -> None:
        with self._lock:
            self._apply(Event.BEGIN_CYCLE)

    def end_cycle(self) -> None:
        with self._lock:
            self._apply(Event.END_CYCLE)

    def announce(self, notice: Notice) -> bool:
        """Records ``notice`` for the next cycle unless one is pending or the engine has
        stopped; returns whether it was recorded."""
        with self._lock:
            if self.notice is not None or self.error is not None:
                return False
            self.notice = notice
            return True

    def stop(self, error: BaseException, abnormal: bool = False) -> None:
        """Stops the engine: every pending and later request fails with the first stop's
        error."""
        self._stopping(Event.FAIL if abnormal else Event.STOP, error)

    def lose_mpi(self, reason: str, error: BaseException) -> None:
        """Stops the engine because some MPI call of this rank may never complete."""
        with self._lock:
            self.stuck_reason = reason
        self._stopping(Event.LOSE_MPI, error)

    def lose_peer(self, rank: int, error: PeerFailureError) -> None:
        """Stops the engine because ``rank``'s process is gone, and tells the other
        survivors: a rank on another node cannot see that process, and each survivor should
        fail with the same error before one of them ends the job (:meth:`leave_job`)."""
        first = self._lose_gone(rank, error)
        if first and self.control.threads_multiple:
            notice = Notice(NoticeKind.FAILURE, rank, error.reason)
            self.control.raise_alarm(notice, self._survivors(mine=False))

    def _lose_gone(self, rank: int, error: BaseException) -> bool:
        """Records that ``rank``'s process is gone and stops the engine with ``error``;
        returns whether this is the engine's first stop."""
        with self._lock:
            self.gone.add(rank)
            first = self.error is None
        self.lose_mpi("a peer is gone", error)
        return first

    def _survivors(self, mine: bool) -> list[int]:
        return [r for r in range(self.size) if r not in self.gone and (mine or r != self.rank)]

    def leave(self, error: BaseException | None = None) -> None:
        """This rank leaves the protocol in the middle of a cycle (then stops with
        ``error`` when given); :meth:`leave_mid_cycle` tells the peers."""
        with self._lock:
            self._apply(Event.LEAVE)
        if error is not None:
            self._stopping(Event.FAIL, error)

    def _stopping(self, event: Event, error: BaseException) -> None:
        with self._lock:
            self._apply(event)
            if self.error is None:
                self.error = error

    # -- alarms -----------------------------------------------------------------------------

    def check_alarm(self) -> bool:
        """Turns a peer's alarm (see :meth:`leave_mid_cycle`) into this rank's error and
        acknowledges it; returns whether there was one (the engine has stopped then).
        Called by the watchdog thread, or by the engine thread while it waits."""
        alarm = self.control.poll_alarm()
        if alarm is None:
            return False
        source, notice = alarm
        self.control.acknowledge(source)
        error = notice.error(self.rank)
        if notice.rank != source:
            # A survivor passes on that notice.rank is gone (see lose_peer).
            if self._lose_gone(notice.rank, error):
                logger.error("%s (seen by rank %d)", error, source)
            return True
        logger.error("%s", error)
        # This rank's engine thread may be blocked in a collective the sender never joins.
        self.lose_mpi(f"rank {source} left a collective unfinished", error)
        return True

    def leave_mid_cycle(self, reason: str) -> None:
        """Tells the peers that this rank failed in the middle of a cycle (the engine is
        stopped already and in ``LEAVING``).

        The peers may be blocked in a collective this rank will never join, or will be in
        the next negotiation, so a notice in the next cycle would never reach them. It goes
        to each of them as an alarm instead; their watchdog thread picks it up within a
        tenth of a second, acknowledges it and fails their collectives with
        ``PeerFailureError(this rank, reason)``. A peer that does not acknowledge within
        ``exit_timeout_s`` cannot hear it (its engine thread is blocked inside MPI and MPI
        lets no other thread in: HOROVOD_MPI_THREADS_DISABLE=1; or it is frozen): MPI_Abort
        then ends the job. A peer the watchdog finds gone meanwhile is not waited for.
        """
        peers = [r for r in range(self.size) if r != self.rank]
        self.control.raise_alarm(Notice(NoticeKind.FAILURE, self.rank, reason), peers)
        deadline = time.monotonic() + self.exit_timeout_s
        missing = set(peers)
        while True:
            missing -= self.control.acknowledged()
            with self._lock:
                missing -= self.gone  # a dead peer (the watchdog's finding) never answers
            if not missing:
                return
            if time.monotonic() >= deadline:
                break
            # A peer that failed at the same time waits for this rank's acknowledgement.
            self.check_alarm()
            time.sleep(0.002)
        self.abort(
            f"ranks {sorted(missing)} did not acknowledge this rank's failure within "
            f"{self.exit_timeout_s:g} s (BAGUAHVD_EXIT_TIMEOUT_SECONDS); they are "
            "blocked in a collective it will not join"
        )

    # -- the end ----------------------------------------------------------------------------

    def leave_job(self, thread_alive: bool) -> None:
        """At interpreter exit, after a failure stopped the engine: waits up to
        ``exit_timeout_s`` for every other live rank to get here too (so each has reported
        the error), then lets MPI finalize. It ends the whole job with MPI_Abort instead when
        some rank does not come (it is stuck, asleep or dead: MPI_Finalize would wait for it
        forever), or when some MPI call of this rank cannot complete (a peer is gone or left
        a collective unfinished, or the engine thread is stuck); then too after the meeting,
        unless no other thread may call MPI now or the lost rank is not known."""
        if not self.abnormal or self.size == 1:
            return
        stuck = self.stuck_reason is not None or thread_alive
        met = False
        if not stuck or (self.control.threads_multiple and -1 not in self.gone):
            met = self.control.exit_barrier(self.exit_timeout_s, self._survivors(mine=True))
        if stuck:
            self.abort(f"{self.stuck_reason or 'the engine thread is stuck'}, so MPI cannot "
                       "finish")
        elif not met:
            self.abort(
                f"not every rank exited within {self.exit_timeout_s:g} s of the "
                "failure (BAGUAHVD_EXIT_TIMEOUT_SECONDS)"
            )
        else:
            # Every rank is here. Whether or not the script caught the error, a job that a
            # failure ended does not exit with 0: the same status on every run.
            logger.error("exiting with status 1: the job was ended by %s", self._reason())
            _flush()
            self.control.end_process(1)

    def _reason(self) -> str:
        error = self.error
        return f"{type(error).__name__}: {error}" if error is not None else "a failure"

    def abort(self, why: str) -> None:
        logger.error("ending the job with %s: %s", self.control.abort_name, why)
        _flush()
        self.control.abort(1)


def _flush() -> None:
    for handler in logging.getLogger("baguahvd").handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
