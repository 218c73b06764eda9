"""Completion of the units the engine launched without waiting for them: device units, on
a device communicator's stream, and host units, whose allreduces run on the threads of
their transport (gloo's, see :attr:`~baguahvd.backends.base.Communicator.launches_allreduce`).

A device communicator launches a unit without waiting for it (see
:meth:`baguahvd.backends.nccl.NCCLCommunicator.ordered`), a host transport starts its
allreduces (:class:`HostUnits` speaks for it here); the dispatcher then adds the unit
here with what completes its handles. The engine thread polls the units between and during
its cycles (:meth:`Completions.wait` replaces its sleep), so it negotiates and launches the
next units while earlier ones still communicate; between cycles, host units whose transport
tells when they end (gloo's futures) wake it instead of being polled. The protocol:

- units complete in launch order, each once its communicator says it has finished: a later
  unit never completes before an earlier one, whichever communicator ran it;
- a unit may be launched in two parts: the communication, and the rest that writes the
  users' outputs from its results (``then``). The rest is launched by a poll that saw the
  first part finish, without error (the communicator's ``check_succeeded``), and the unit
  completes once the rest has finished too: after an abort, kernels queued behind the
  aborted call still run, and none of them may write into tensors whose handles fail;
- a unit that cannot finish (an NCCL error, the timeout, the engine stopping) raises
  :class:`CollectiveFailure` from the poll that noticed it, as a failure while running it
  would have;
- at a normal end of the job every unit is waited for (:meth:`Completions.drain`); when the
  engine thread stops otherwise, units still running are abandoned
  (:meth:`Completions.abandon`): their communicators are aborted so no kernel keeps waiting
  for a peer that is gone, and their handles fail.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from baguahvd.backends.base import Pending, Started, waits
from baguahvd.common.exceptions import HorovodInternalError
from baguahvd.engine.buffers import FusionBuffers, FusionPool
from baguahvd.engine.clock import SYSTEM_CLOCK, Clock
from baguahvd.engine.requests import Entry, Request
from baguahvd.engine.timeline import Timeline


class Outcome(NamedTuple):
    """How one request ended: its results (and what its handle's ``extra`` holds), or its
    error. The parts that run collectives return outcomes; :func:`deliver` hands them to the
    handles."""

    request: Request
    result: list[torch.Tensor] | None = None
    extra: Any = None
    error: BaseException | None = None


_new_tuple = tuple.__new__


def succeeded(requests: Iterable[Request]) -> list[Outcome]:
    """The outcomes of requests that ended with their outputs as results (built without
    the keyword handling of ``Outcome(...)``: a fused unit has hundreds)."""
    return [_new_tuple(Outcome, (request, request.outputs, None, None)) for request in requests]


def deliver(outcomes: Sequence[Outcome], timeline: Timeline | None = None) -> None:
    """Completes or fails the handles of ``outcomes``, after recording them in rank 0's
    ``timeline``: the user may stop the timeline as soon as a handle is released."""
    if timeline is not None and timeline.active:
        for outcome in outcomes:
            meta = outcome.request.meta
            timeline.done(meta.name, {"dtype": meta.dtype, "shape": str(list(meta.shapes))})
    # Last first: a thread waiting for the first handle of a batch (synchronize in
    # submission order) wakes once, when the whole batch is done.
    for request, result, extra, error in reversed(outcomes):
        if error is not None:
            request.handle.fail(error)
        else:
            request.handle.complete(result, extra)


def keep_named(exc: BaseException, otherwise: HorovodInternalError) -> HorovodInternalError:
    """The error a failed collective's handles raise: ``exc`` itself when it is a
    HorovodInternalError (named failures, such as an NCCL error or timeout, keep their class
    for ``except``), else ``otherwise``."""
    return exc if isinstance(exc, HorovodInternalError) else otherwise


_FIRST_POLL_S = 2e-6
_LONGEST_POLL_S = 1e-3

POLL_DURING_AND_S = 2e-4
"""How often the engine thread looks at the units it launched while it waits in a cycle's
bitwise AND that does not tell when it ends (:meth:`Completions.through`)."""
TOLD_WAIT_S = 0.01
"""The longest sleep of :meth:`Completions.through` while the AND and every unit in flight
will tell when they end: between two, the engine thread checks whether to give up."""


class CollectiveFailure(Exception):
    """A unit of agreed collectives raised on this rank while it ran (engine thread)."""

    def __init__(self, unit: list[Entry], error: Exception) -> None:
        super().__init__(str(error))
        self.unit = unit
        self.error = error


class HostLaunched(NamedTuple):
    """A host unit's allreduces, started on their transport's threads (none once the rest
    of the unit has run)."""

    started: tuple[Started, ...] = ()


class HostUnits:
    """The communicator of host units, as :class:`Completions` sees it: a unit has finished
    once each of its allreduces has completed, and fails with the first one that failed.
    Their fusion buffers come from :attr:`buffers`, one set per unit in flight."""

    def __init__(self) -> None:
        self.buffers = FusionPool()

    def then(
        self, rest: Callable[[], None] | None, buffers: FusionBuffers
    ) -> Callable[[], HostLaunched]:
        """The second part of a host unit: ``rest`` (the scaling after, the copy out), then
        its fusion buffers go back."""

        def run_rest() -> HostLaunched:
            if rest is not None:
                rest()
            self.buffers.give_back(buffers)
            return HostLaunched()

        return run_rest

    def finished(self, launched: HostLaunched) -> bool:
        return all(started.test() for started in launched.started)

    def wait(self, launched: HostLaunched) -> None:
        for started in launched.started:
            started.wait()

    def check_succeeded(self, launched: HostLaunched) -> None:
        """Nothing left to check: an allreduce that failed raised in :meth:`finished`."""

    def abort(self, reason: str) -> None:
        """Nothing to abort: an allreduce whose peers are gone ends with an error of its own
        (its connections close, or the group's timeout passes), as one that the engine
        thread waited in would."""


class _Pending(NamedTuple):
    comm: Any
    """The device communicator, or :class:`HostUnits` for host units: ``finished(launched)``,
    ``wait(launched)``, ``abort()`` and, for units in two parts,
    ``check_succeeded(launched)``."""
    launched: Any
    unit: list[Entry]
    outcomes: list[Outcome]
    then: Callable[[], Any] | None
    """Launches the unit's second part once the first has finished (returns what
    ``finished`` takes); None once launched, or for a unit of one part."""
    told: bool = False
    """Whether the unit sets :attr:`Completions.woken` when it has finished (or has nothing
    left to wait for), so that nothing need poll it."""


class Completions:
    """The launched units not completed yet, in launch order (see module docstring).

    Only the engine thread adds, polls, drains and abandons; other threads may read
    :meth:`requests` (to fail them when the engine stops). ``timeline``: rank 0's, where
    completed units are recorded.
    """

    def __init__(self, timeline: Timeline | None = None) -> None:
        self._units: list[_Pending] = []
        self.timeline = timeline
        self.host = HostUnits()
        """What completes host units, and their fusion buffers."""
        self.woken: threading.Event | None = None
        """The engine's wake-up, which a host unit sets when its transport says it has
        finished (:meth:`Started.notify`): :meth:`wait` then sleeps until then instead of
        polling every millisecond, which on the emulated 1 Gbit/s cluster (a step's
        buckets in flight for 280 ms) was most of the engine thread's CPU time per step
        (see ``loop.PAUSE_WHILE_TOLD_S``)."""
        self.bell = threading.Event()
        """Set, with :attr:`woken`, when a unit tells that it has ended, and by the AND that
        :meth:`through` waits for: what that wait sleeps on."""

    def __len__(self) -> int:
        return len(self._units)

    def add(
        self, comm: Any, launched: Any, unit: list[Entry], outcomes: list[Outcome],
        then: Callable[[], Any] | None = None,
    ) -> None:
        """Adds a launched unit, the outcomes its handles get once it has finished and, for
        a unit in two parts, what launches the second (see module docstring)."""
        told = (
            comm is self.host and self.woken is not None
            and all([started.notify(self._told) for started in launched.started])
        )
        self._units.append(_Pending(comm, launched, unit, outcomes, then, told))

    def _told(self) -> None:
        """A unit's transport says it has ended (in the transport's thread)."""
        self.bell.set()
        woken = self.woken
        if woken is not None:
            woken.set()

    def all_tell(self) -> bool:
        """Whether units are in flight and each will wake the engine when it has ended."""
        units = self._units
        return bool(units) and all([pending.told for pending in units])

    def complete(self, unit: list[Entry], outcomes: list[Outcome]) -> None:
        """Completes the handles of a unit that ran in the call: at once, or, while units
        launched before it still run, after them (a barrier returns once the allreduces
        before it are done)."""
        if self._units:
            self._units.append(_Pending(self.host, HostLaunched(), unit, outcomes, None, True))
        else:
            deliver(outcomes, self.timeline)

    def requests(self) -> list[Request]:
        """The requests of the units not completed yet."""
        units = list(self._units)
        return [request for pending in units for _, request in pending.unit
                if request is not None]

    def poll(self) -> bool:
        """Completes the finished units at the head of the queue, and launches the second
        part of every unit whose first part has finished; never blocks. Returns whether it
        launched a second part (short: worth polling again soon)."""
        units = self._units
        index = 0
        launched = False
        while index < len(units):
            pending = units[index]
            if pending.then is None and index > 0:
                # Finished or not, it completes after the units before it.
                index += 1
                continue
            try:
                done = pending.comm.finished(pending.launched)
            except Exception as exc:
                raise CollectiveFailure(pending.unit, exc) from exc
            if not done:
                if index > 0:
                    break
                index += 1
            elif pending.then is not None:
                units[index] = self._go_on(pending)
                launched = True
                if index > 0:
                    index += 1
                # The head is looked at again: a host unit's rest has run in the call.
            else:
                self._complete()
        return launched

    def drain(self) -> None:
        """Waits for every unit and completes it (the job ends normally)."""
        units = self._units
        while units:
            pending = units[0]
            try:
                pending.comm.wait(pending.launched)
            except Exception as exc:
                raise CollectiveFailure(pending.unit, exc) from exc
            if pending.then is not None:
                units[0] = self._go_on(pending)
            else:
                self._complete()

    @staticmethod
    def _go_on(pending: _Pending) -> _Pending:
        """Launches the second part of a unit whose first part has finished."""
        assert pending.then is not None
        try:
            pending.comm.check_succeeded(pending.launched)
            return pending._replace(launched=pending.then(), then=None)
        except Exception as exc:
            raise CollectiveFailure(pending.unit, exc) from exc

    def wait(
        self, wake: threading.Event, timeout_s: float, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        """``wake.wait(timeout_s)`` on ``clock`` that completes units as they finish
        meanwhile."""
        self.poll()
        if not self._units:
            clock.wait(wake, timeout_s)
            return
        deadline = clock.now() + timeout_s
        delay = _FIRST_POLL_S
        while not wake.is_set():
            left = deadline - clock.now()
            if left <= 0:
                return
            units = self._units
            if not units:
                clock.wait(wake, left)
                return
            if wake is self.woken and self.all_tell():
                # Each unit wakes the engine when it has finished: no polling meanwhile.
                clock.wait(wake, left)
            else:
                clock.wait(wake, min(delay, left))
            delay = _FIRST_POLL_S if self.poll() else min(delay * 2, _LONGEST_POLL_S)

    def through(self, pending: Pending, check: Callable[[], None]) -> None:
        """Waits for the control-plane operation ``pending`` (a cycle's bitwise AND: over a
        slow link it waits behind the units' bytes, or for a peer's pause), completing
        units as they finish meanwhile and calling ``check`` between waits (it raises to
        give up). Where the AND and every unit in flight tell when they end (gloo's
        futures), it sleeps until one of them does; else it tests between short waits
        (:func:`~baguahvd.backends.base.waits`) and polls the units every
        :data:`POLL_DURING_AND_S`."""
        self.bell.clear()
        told = pending.notify(self.bell.set) and (not self._units or self.all_tell())
        steps = (
            waits(pending, self._ring, TOLD_WAIT_S, TOLD_WAIT_S) if told else waits(pending)
        )
        next_poll = 0.0
        for _ in steps:
            check()
            if self._units:
                now = time.perf_counter()
                if told or now >= next_poll:
                    self.poll()
                    next_poll = now + POLL_DURING_AND_S

    def _ring(self, timeout_s: float) -> None:
        """Sleeps until :attr:`bell` rings or ``timeout_s`` has passed, and resets it: what
        ended meanwhile is found by the test and the poll that follow."""
        self.bell.wait(timeout_s)
        self.bell.clear()

    def abandon(self, error: BaseException) -> None:
        """Gives up the units still running (the engine thread stops): aborts their
        communicators and fails their handles with ``error``."""
        units, self._units = self._units, []
        aborted: set[int] = set()
        for pending in units:
            if id(pending.comm) not in aborted:
                aborted.add(id(pending.comm))
                pending.comm.abort(
                    f"{len(units)} collective(s) were abandoned because the engine stopped: "
                    f"{error}"
                )
            for _, request in pending.unit:
                if request is not None:
                    request.handle.fail(keep_named(
                        error, HorovodInternalError(f"{request.meta.name}: {error}")))

    def _complete(self) -> None:
        deliver(self._units.pop(0).outcomes, self.timeline)
