"""The engine thread: one cycle after another until the job ends.

Each cycle (:meth:`EngineLoop.cycle`) asks the parts in turn and acts on what they return:
the intake's new requests go to the negotiator; the negotiator's announcement goes into the
bitwise AND over the ranks; the negotiator reads the AND and returns the agreed work (cached
hits, then rank 0's responses), and files the negotiated responses in the response cache
before any runs; the work goes through the fusion plan to the dispatcher, unit by unit; what
the cycle decided about autotune settings is applied at its end.

The AND is the cycle's one wait for the other ranks, and this loop does it: the control
plane only starts it, and between the waits of
:meth:`~baguahvd.engine.execution.completion.Completions.through` the loop checks whether
the engine has stopped (a peer's alarm, a lost peer) and gives up then; the units it
launched earlier that have finished meanwhile complete. Nothing below
calls back into the engine. The protocol is in :mod:`baguahvd.engine.engine`; a failure on
this thread ends the job as :meth:`EngineLoop.run` says.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import NoReturn

import numpy as np
import torch

from baguahvd.backends.base import ControlPlane
from baguahvd.common.config import Config
from baguahvd.common.exceptions import HorovodInternalError, PeerFailureError, ShutDownError
from baguahvd.engine.autotune import Autotuner, Settings
from baguahvd.engine.clock import SYSTEM_CLOCK, Clock
from baguahvd.engine.execution.completion import (
    CollectiveFailure,
    Outcome,
    deliver,
    keep_named,
)
from baguahvd.engine.execution.dispatch import Dispatcher
from baguahvd.engine.execution.fusion import FusionPlans, unfused_sizes
from baguahvd.engine.intake import RequestQueue
from baguahvd.engine.lifecycle.states import Lifecycle, State
from baguahvd.engine.messages import OpType
from baguahvd.engine.negotiation.negotiator import IDLE_PAUSE_MAX_S, Negotiator
from baguahvd.engine.negotiation.stall import StallInspector
from baguahvd.engine.notices import Decision, Notice, NoticeKind, describe_exception
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Entry, Request
from baguahvd.engine.scheduling import prompt_wakeups
from baguahvd.engine.submission import Submissions
from baguahvd.engine.timeline import Timeline

logger = logging.getLogger("baguahvd.engine")

ATTRIBUTION_S = 5.0
"""How long the engine thread looks for the cause of a failed exchange, the bitwise AND or
the negotiation with rank 0 (the rank that died), before it raises the transport's error."""


PAUSE_WHILE_TOLD_S = 0.064
"""The pause between idle cycles while every unit in flight will wake the engine when it
ends (gloo's allreduces: a step's gradient buckets over a slow link), instead of
:data:`IDLE_PAUSE_MAX_S`: a submission or a finished transfer wakes the engine anyway, and
each idle cycle's bitwise AND waits behind the transfers' bytes on the link. An
announcement (a rank shutting down) reaches an idle rank within this pause. With
:attr:`Completions.woken` it took the engine thread's CPU time per step on the emulated
1 Gbit/s cluster from 31-44 ms to 16-28 (``benchmarks/results/bucket_timeline/NOTES.md``)."""


class _Abandoned(Exception):
    """The engine thread stops waiting for its peers: the job is ending."""


class EngineLoop:
    """The engine thread's state and its cycle (see module docstring).

    Args:
        config: the job's configuration.
        control: the negotiation channel over every rank of the job.
        process_sets: the registered process sets, by id.
        queue: the intake the cycles take new requests from.
        submissions: this rank's count of unnamed requests (a joined rank's advances with
            the collectives it takes part in without submitting them).
        lifecycle: the engine's lifecycle.
        dispatch: runs the agreed units.
        timeline: rank 0's timeline, if any.
        clock: what the pauses between cycles are waited on (tests step their own).
    """

    def __init__(
        self,
        config: Config,
        control: ControlPlane,
        process_sets: dict[int, ProcessSetState],
        queue: RequestQueue,
        submissions: Submissions,
        lifecycle: Lifecycle,
        dispatch: Dispatcher,
        timeline: Timeline | None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config, self.control, self.process_sets = config, control, process_sets
        self.rank = control.rank
        self.queue, self.lifecycle, self.dispatch, self.timeline = (
            queue, lifecycle, dispatch, timeline
        )
        self.clock = clock
        dispatch.pending.woken = queue.wake  # host units wake the engine when they finish
        self.submissions = submissions
        self.inspector = StallInspector(
            config.stall_check_time_s, config.stall_shutdown_time_s, config.stall_check_disable
        )
        self.negotiation = Negotiator(
            self.rank, control.size, control, process_sets, config.cache_capacity,
            self.inspector, timeline,
        )
        self.executing: list[Request] = []
        """The requests of the units this cycle runs (failed with the rest if it stops)."""
        self.cycles = 0
        self.fusion_plans = FusionPlans()
        """The fusion plans of recent cycles, which a training step's cycles repeat."""
        self.settings = Settings(config.fusion_threshold, config.cycle_time_ms)
        """The fusion threshold and cycle time in use (autotune changes them)."""
        self.settings_changes: list[tuple[int, Settings]] = []
        """Autotune: (cycle, settings) of every change, the cycle being the last one run
        under the previous settings; the same on every rank."""
        self.tuner = (
            Autotuner(
                self.settings, config.autotune_warmup_samples,
                config.autotune_steps_per_sample, config.autotune_max_samples,
                config.autotune_log,
                (config.hierarchical_allreduce, config.hierarchical_allgather,
                 config.cache_capacity > 0),
            )
            if config.autotune and self.rank == 0 and control.size > 1
            else None
        )

    def run(self) -> None:
        """The engine thread's body: cycles until the job ends, then fails what is left."""
        prompt_wakeups()
        torch.set_grad_enabled(False)  # for this thread: collectives write raw buffers
        if self.config.thread_affinity:
            cores = self.config.thread_affinity
            try:
                os.sched_setaffinity(0, {cores[self.rank % len(cores)]})
            except (AttributeError, OSError) as exc:
                logger.warning("could not pin the engine thread: %s", exc)
        lifecycle = self.lifecycle
        queue = self.queue
        pending = self.dispatch.pending
        try:
            while lifecycle.error is None:
                cycle_ms = self.settings.cycle_time_ms
                # While requests are in flight, the next cycle starts at once: peers are
                # waiting for this rank to announce what it has; an idle job pauses longer.
                # Meanwhile, device units launched earlier complete as they finish.
                pause = self.negotiation.pause_s(cycle_ms)
                if pause >= IDLE_PAUSE_MAX_S and pending.all_tell():
                    pause = PAUSE_WHILE_TOLD_S
                pending.wait(queue.wake, pause, self.clock)
                queue.wake.clear()
                queue.let_burst_finish(cycle_ms)
                if not self.cycle():
                    break
        except _Abandoned:
            pass
        except CollectiveFailure as failure:
            self._collective_failed(failure)
        except BaseException as exc:  # noqa: BLE001 - the error is handed to every waiter
            self._internal_error(exc)
        finally:
            if len(pending):
                pending.abandon(lifecycle.error or ShutDownError())

    def cycle(self) -> bool:
        """One negotiation round; returns False once the job is shutting down."""
        self.cycles += 1
        new = self.queue.take()
        lifecycle = self.lifecycle
        notice = lifecycle.notice
        negotiation = self.negotiation
        if new:
            self.inject_fault("admit", new)
            negotiation.admit_all(new)
        now = time.monotonic()
        if self.inspector.due(now) and (stall := negotiation.check_stalls(now)) is not None:
            lifecycle.announce(stall)
        # Units still running do not keep the job from pausing: the pause's wait completes
        # them as they finish, and a cycle during one only waits behind its bytes.
        words = negotiation.announcement(notice)
        # From here until the cycle ends, ranks are in the middle of the same exchange.
        lifecycle.begin_cycle()
        agreed = self._bitwise_and(words)
        if negotiation.end_agreed(agreed):
            # Some rank announced the end of the job: this cycle runs nothing, and the
            # device units every rank launched finish first.
            self.dispatch.pending.drain()
            decision = self._negotiate(notice)
            final = decision.notice or Notice(NoticeKind.SHUTDOWN, -1)
            lifecycle.stop(final.error(self.rank), abnormal=final.abnormal)
            self.fail_pending()
            lifecycle.end_cycle()
            return False
        entries = negotiation.cached_work(agreed)
        negotiated: list[Entry] = []
        if negotiation.exchange_agreed(agreed):
            negotiated = negotiation.answered(self._negotiate(None).responses)
            entries += negotiated
        for response, own in negotiated:
            if own is None:
                # Ran (or failed) while this rank had joined: count it, before the join can
                # return, so that this rank's next unnamed collective pairs with the others'.
                self.submissions.skip_unnamed(response.meta.process_set_id, response.meta.key)
        # Every rank files the same responses in the same order before any runs (see
        # Negotiator.file_responses); requests that waited on a set removed in this cycle
        # fail once its removal has run.
        orphans = negotiation.file_responses(negotiated)
        self.executing = [request for _, request in entries if request is not None]
        self.executing += [request for waited in orphans.values() for request in waited]
        timeline = self.timeline
        if timeline is not None and timeline.active and entries:
            timeline.cycle_started()
            for response, own in entries:
                if own is not None:
                    # The request's name: an unnamed hit runs under an earlier call's response.
                    timeline.queued(own.meta.name, response.meta.op, own.activity)
        self.inject_fault("run", entries)
        for unit in self.fusion_plans.plan(
            entries, self.settings.fusion_threshold, self.config.disable_group_fusion,
            unfused_sizes(self.process_sets, self.config.unfused_bytes),
        ):
            try:
                self.dispatch.run_unit(unit)
            except Exception as exc:
                raise CollectiveFailure(unit, exc) from exc
            response = unit[0][0]
            if response.meta.op == OpType.REMOVE_PROCESS_SET and response.error is None:
                self._removed(response.meta.payload[0], orphans.pop(response.meta.payload[0]))
        self.executing = []
        self.queue.release_retries()
        if self.tuner is not None and not self.tuner.frozen:
            proposal = self.tuner.record(_reduced(entries))
            if proposal is not None:
                negotiation.propose(proposal)
        lifecycle.end_cycle()
        agreed_settings = negotiation.take_agreed_settings()
        if agreed_settings is not None:
            # Every rank got these in this cycle's decision: all switch between this cycle
            # and the next.
            self.settings = agreed_settings
            self.settings_changes.append((self.cycles, agreed_settings))
            if self.tuner is not None:
                self.tuner.applied(agreed_settings)
        return True

    def inject_fault(self, stage: str, work: Sequence[object]) -> None:
        """The one seam for fault-injection tests; does nothing. The engine thread calls it
        with ``"admit"`` and the requests it takes from the queue, before negotiating them
        (between cycles), and with ``"run"`` and the cycle's agreed work ((response,
        request) pairs) before fusing and running it (mid-cycle). A test replaces it with a
        function that raises, to see how the ranks end a job whose engine fails there."""

    def _bitwise_and(self, words: np.ndarray) -> np.ndarray:
        """The cycle's bitwise AND over the ranks. While the others have not all come, the
        engine thread checks between waits whether the engine has stopped (a peer's alarm,
        a lost peer) and gives up then: the job is ending."""
        pending = self.control.start_bitwise_and(words)
        try:
            # Units launched earlier complete while the AND waits.
            self.dispatch.pending.through(pending, self._give_up_if_stopped)
        except RuntimeError as error:
            self._raise_attributed(error)
        return pending.result()

    def _negotiate(self, notice: Notice | None) -> Decision:
        """The cycle's exchange with rank 0 (:meth:`Negotiator.negotiate`), whose failure
        is attributed as the AND's is."""
        try:
            return self.negotiation.negotiate(notice)
        except RuntimeError as error:
            self._raise_attributed(error)

    def _raise_attributed(self, error: RuntimeError) -> NoReturn:
        """An exchange with the other ranks failed on this rank (gloo: a peer's connection
        closed). Its error names an address, not a rank: the watchdog usually names the
        rank that died (or a peer's alarm says why it left) within moments, so the engine
        gives up with that reason once it has one, and raises ``error`` only after
        :data:`ATTRIBUTION_S` without."""
        deadline = time.monotonic() + ATTRIBUTION_S
        while time.monotonic() < deadline:
            self._give_up_if_stopped()
            time.sleep(0.05)
        raise error

    def _give_up_if_stopped(self) -> None:
        """Between two waits for the other ranks: takes in a peer's alarm where no other
        thread may (see :attr:`ControlPlane.threads_multiple`), and ends the wait once the
        engine has stopped."""
        if not self.control.threads_multiple and self.lifecycle.check_alarm():
            self.fail_pending()
        if self.lifecycle.error is not None:
            raise _Abandoned

    def _internal_error(self, exc: BaseException) -> None:
        """A bug in the engine: fail this rank's requests and make sure the others do not
        wait for it forever."""
        logger.exception("the engine stopped after an internal error")
        reason = f"baguahvd engine failed: {describe_exception(exc)}"
        lifecycle = self.lifecycle
        error = PeerFailureError(self.rank, reason)
        if lifecycle.state is not State.IDLE:
            # Mid-cycle (or stopped already), the peers may wait in an exchange this rank
            # will not finish: tell them with an alarm; shutdown() waits for it to go out.
            lifecycle.leave(error)
            self.fail_pending()
        else:
            lifecycle.stop(error, abnormal=True)
            self.fail_pending()
            # Between cycles every rank is at the same point of the protocol: announce the
            # failure in one more cycle, as an uncaught exception would.
            try:
                self.negotiation.announce_end(Notice(NoticeKind.FAILURE, self.rank, reason))
                return
            except BaseException:  # noqa: BLE001 - falls back to an alarm
                logger.exception("could not tell the other ranks in a cycle")
                lifecycle.leave()
        lifecycle.leave_mid_cycle(reason)

    def _collective_failed(self, failure: CollectiveFailure) -> None:
        """A collective raised on this rank while it ran: this rank leaves the protocol (its
        peers may wait in that collective, or its data communicators are out of step with
        theirs), and every rank's pending and later collectives raise the error."""
        exc = failure.error
        names = [
            (response if request is None else request).meta.name
            for response, request in failure.unit
        ]
        name = names[0] if len(names) == 1 else f"{names[0]} (fused with {len(names) - 1} more)"
        logger.error("%s failed on this rank; ending the job", name, exc_info=exc)
        reason = f"{name}: {describe_exception(exc)}"
        error = PeerFailureError(self.rank, reason)
        lifecycle = self.lifecycle
        lifecycle.leave()
        deliver([
            Outcome(request, error=keep_named(exc, error)) for _, request in failure.unit
            if request is not None and not request.handle.done()
        ], self.timeline)
        lifecycle.stop(error, abnormal=True)
        self.fail_pending()
        lifecycle.leave_mid_cycle(reason)

    def _removed(self, ident: int, orphans: list[Request]) -> None:
        # The requests that waited on a removed set's cached responses can never run.
        deliver([
            Outcome(request, error=HorovodInternalError(
                f"{request.meta.name}: process set {ident} was removed."))
            for request in orphans
        ], self.timeline)

    def fail_pending(self) -> None:
        """After a stop of the lifecycle: fails every request this rank still holds,
        wherever it is, with the stop error (any thread; the engine calls it after every
        stop, as the lifecycle calls nothing back)."""
        error = self.lifecycle.error
        if error is None:
            return
        pending = [
            *self.queue.drain(), *self.negotiation.drain(), *self.executing,
            *self.dispatch.pending.requests(),
        ]
        for request in pending:
            if not request.handle.done():
                request.handle.fail(error)



def _reduced(entries: list[Entry]) -> list[tuple[str, int]]:
    """Name and bytes of this rank's allreduces among a cycle's entries (autotune's measure)."""
    return [
        (own.meta.name, sum(t.numel() * t.element_size() for t in own.inputs))
        for response, own in entries
        if own is not None and response.meta.op == OpType.ALLREDUCE and response.error is None
    ]

