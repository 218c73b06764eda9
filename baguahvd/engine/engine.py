"""The engine: one background thread per process owns every collective call.

User threads call :meth:`Engine.submit`, which queues a :class:`Request` and returns its
:class:`Handle`. Each cycle the engine thread

1. announces its pending requests: requests whose response is cached cost one bit each in a
   bitwise AND over the ranks; the others are sent, with their metadata, to rank 0;
2. (rank 0) matches requests by name across the members of their process set, checks they
   agree, and broadcasts the list of collectives that are ready everywhere;
3. fuses ready allreduces with the same dtype, op, factors and process set into buffers of up
   to ``fusion_threshold`` bytes, runs everything in the agreed order and completes handles.

A cycle starts once the thread that submits requests waits for one of them or pauses (see
:mod:`~baguahvd.engine.intake`), or after ``cycle_time_ms`` otherwise.
Process sets with a single member never leave the calling thread.

Nothing waits forever. A rank that shuts down, fails (an uncaught exception, a broken
engine) or whose collectives stall past the shutdown time (rank 0's
:mod:`~baguahvd.engine.stall` inspector) ends the job in the next cycle with a
:mod:`~baguahvd.engine.notices` notice that every rank turns into the same error; a peer
that dies or freezes is noticed by the :mod:`~baguahvd.engine.watchdog`. A rank that fails
in the middle of a cycle (a collective that raises on this rank only: no memory for the
fusion buffer, a backend error) cannot wait for the next one, since its peers may be blocked
in a collective it will never join: it sends the notice as an alarm outside the protocol
(see :meth:`~baguahvd.engine.lifecycle.Lifecycle.leave_mid_cycle`). Rank 0 records what
happens in the :mod:`~baguahvd.engine.timeline` when HOROVOD_TIMELINE is set.

This module keeps the loop and asks its parts, acting on what they return: the
:mod:`~baguahvd.engine.intake` queue, the :mod:`~baguahvd.engine.negotiation` (with the
:mod:`~baguahvd.engine.coordinator` and the response cache), the
:mod:`~baguahvd.engine.fusion` plan, the :mod:`~baguahvd.engine.dispatch` (device units
complete in :mod:`~baguahvd.engine.completion`), the :mod:`~baguahvd.engine.lifecycle` and
:mod:`~baguahvd.engine.autotune`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from baguahvd.backends.base import ControlPlane, DeviceCommFactory
from baguahvd.common.config import Config
from baguahvd.common.exceptions import (
    HorovodInternalError,
    PeerFailureError,
    ProcessSetError,
    ShutDownError,
)
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.autotune import Autotuner, Settings
from baguahvd.engine.completion import keep_named
from baguahvd.engine.dispatch import CollectiveFailure, Dispatcher
from baguahvd.engine.fusion import plan_fusion, unfused_sizes
from baguahvd.engine.intake import RequestQueue, ThreadActivity, describe_tensors
from baguahvd.engine.lifecycle import Lifecycle, State
from baguahvd.engine.messages import GLOBAL_PROCESS_SET_ID, OpType, RequestMeta
from baguahvd.engine.negotiation import Negotiator
from baguahvd.engine.notices import Notice, NoticeKind, describe_exception
from baguahvd.engine.process_sets import ProcessSetRegistry, not_member_message
from baguahvd.engine.requests import Entry, Handle, Outcome, Request, deliver
from baguahvd.engine.stall import StallInspector
from baguahvd.engine.timeline import Timeline
from baguahvd.engine.watchdog import Watchdog, process_identity

__all__ = ["GLOBAL_PROCESS_SET_ID", "Engine"]

logger = logging.getLogger("baguahvd.engine")


class _Abandoned(Exception):
    """The engine thread stops waiting for its peers: the job is ending."""


class Engine:
    """Negotiates, fuses and runs the collectives of this process (see module docstring).

    Args:
        config: the job's configuration.
        control: the negotiation channel over every rank of the job.
        device_comms: makes a process set's device (GPU) communicator from its data
            communicator; without it, GPU collectives fail.
    """

    def __init__(
        self,
        config: Config,
        control: ControlPlane,
        device_comms: DeviceCommFactory | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.rank = control.rank
        self.size = control.size
        self._registry = ProcessSetRegistry(self.rank, self.size, control)
        self.process_sets = self._registry.states
        self._queue = RequestQueue(self.rank, config.check_call_sites)
        self._lifecycle = Lifecycle(
            self.rank, self.size, control, config.exit_timeout_s, self._fail_everything
        )
        self._thread: threading.Thread | None = None
        self._watchdog: Watchdog | None = None
        self.timeline = (
            Timeline(config.timeline_start_step, config.timeline_end_step)
            if config.timeline and self.rank == 0
            else None
        )
        """Rank 0's timeline when HOROVOD_TIMELINE is set (written only while started)."""
        # Engine-thread state.
        self._inspector = StallInspector(
            config.stall_check_time_s, config.stall_shutdown_time_s, config.stall_check_disable
        )
        self._negotiation = Negotiator(
            self.rank, self.size, control, self.process_sets, config.cache_capacity,
            self._inspector, self.timeline,
        )
        self._dispatch = Dispatcher(
            self.rank, self.process_sets, self.timeline, device_comms,
            registry=self._registry, device_timeout_s=config.nccl_timeout_s,
            stopped=self._lifecycle.stop_error, single_rank_nccl=config.nccl_single_rank,
            nccl_average=config.nccl_average,
        )
        self._executing: list[Request] = []
        self.cycles = 0
        self.settings = Settings(config.fusion_threshold, config.cycle_time_ms)
        """The fusion threshold and cycle time in use (autotune changes them)."""
        self.settings_changes: list[tuple[int, Settings]] = []
        """Autotune: (cycle, settings) of every change, the cycle being the last one run
        under the previous settings; the same on every rank."""
        self._tuner = (
            Autotuner(
                self.settings, config.autotune_warmup_samples,
                config.autotune_steps_per_sample, config.autotune_max_samples,
                config.autotune_log,
                (config.hierarchical_allreduce, config.hierarchical_allgather,
                 config.cache_capacity > 0),
            )
            if config.autotune and self.rank == 0 and self.size > 1
            else None
        )
        self._activity = ThreadActivity()

    @contextlib.contextmanager
    def activity(self, name: str) -> Iterator[None]:
        """Tags the requests this thread submits inside the block with a timeline activity.

        The timeline draws ``name`` (e.g. ``BAGUA_BYTEGRAD``) around each of their
        collectives, so a trace shows which collectives an algorithm issued without reading
        anything into their names. Blocks nest; the innermost one counts.
        """
        previous = self._activity.name
        self._activity.name = name
        try:
            yield
        finally:
            self._activity.name = previous

    # ----------------------------------------------------------------------------------
    # Process sets

    def register_process_set(self, ranks: Sequence[int]) -> int:
        """Registers a process set collectively; call on every rank in the same order before
        :meth:`start` (static sets) or through an ADD_PROCESS_SET request (dynamic)."""
        return self._registry.register(ranks)

    def _forget_process_set(self, ident: int) -> None:
        # The requests that waited on a removed set's cached responses can never run.
        deliver([
            Outcome(request, error=HorovodInternalError(
                f"{request.meta.name}: process set {ident} was removed."))
            for request in self._negotiation.forget_process_set(ident)
        ], self.timeline)

    # ----------------------------------------------------------------------------------
    # Lifecycle

    @property
    def running(self) -> bool:
        return self._lifecycle.running

    @property
    def abnormal(self) -> bool:
        """Whether the engine stopped because something failed (see :meth:`leave_job`)."""
        return self._lifecycle.abnormal

    @property
    def autotuning(self) -> bool:
        """Whether this rank's autotune (rank 0's) still searches the fusion threshold and
        cycle time."""
        return self._tuner is not None and not self._tuner.frozen

    @property
    def state(self) -> State:
        """The lifecycle state (:class:`~baguahvd.engine.lifecycle.State`)."""
        return self._lifecycle.state

    def start(self) -> None:
        """Starts the engine thread (collective: every rank calls it during ``init()``)."""
        if self.timeline is not None and self.config.timeline != "DYNAMIC":
            assert self.config.timeline is not None
            try:
                self.start_timeline(self.config.timeline, self.config.timeline_mark_cycles)
            except OSError as exc:
                # Only rank 0 writes: failing here would leave the others waiting for it.
                logger.error("HOROVOD_TIMELINE: cannot write the timeline: %s", exc)
        if self.size == 1:
            return
        identities = self.control.allgather_ints(process_identity())
        self._thread = threading.Thread(target=self._run, name="baguahvd-engine", daemon=True)
        # Alarms are looked for by the watchdog when the control plane lets a second thread
        # in while the engine thread waits inside a collective; otherwise only by the engine
        # thread (see _waiting), which cannot while it is blocked in a data collective.
        self._watchdog = Watchdog(
            self.rank, identities, lambda: self.cycles, self._peer_lost,
            self.config.peer_timeout_s,
            poll=self._lifecycle.check_alarm if self.control.threads_multiple else None,
        )
        self._thread.start()
        self._watchdog.start()

    def shutdown(self, failure: str | None = None, timeout: float = 30.0) -> None:
        """Stops the engine on every rank: the others notice in their next cycle.

        Args:
            failure: why this rank stops, when it fails (``Type: message``); the other
                ranks' collectives then raise ``PeerFailureError`` with it.
            timeout: seconds to wait for the last cycle (a dead peer never completes it).
        """
        self._announce(failure)
        lifecycle = self._lifecycle
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            deadline = time.monotonic() + timeout
            # A failure noticed meanwhile (a dead peer) may leave the thread stuck in MPI;
            # one that is telling the peers of this rank's failure ends in bounded time.
            while (thread.is_alive() and time.monotonic() < deadline
                   and not lifecycle.may_be_stuck):
                thread.join(0.05)
            if thread.is_alive() and not lifecycle.abnormal:
                logger.warning(
                    "the engine thread did not stop within %.0f s (a peer may have died)",
                    timeout,
                )
        if self._watchdog is not None:
            self._watchdog.stop()
        lifecycle.stop(ShutDownError())
        if self.timeline is not None:
            self.timeline.close()
        if self._tuner is not None:
            self._tuner.close()

    def release(self) -> None:
        """Frees every process set's communicators and the control plane after a normal
        :meth:`shutdown`. Does nothing while the engine thread still runs (it may be in a
        collective) or after a failure (:meth:`leave_job` still needs the control plane)."""
        thread = self._thread
        if (thread is not None and thread.is_alive()) or self.abnormal:
            return
        for ident in list(self.process_sets):
            self._registry.remove(ident)
        self.control.free()

    def fail(self, reason: str) -> None:
        """Ends the job because this rank failed, without waiting: every other rank's
        pending and later collectives raise ``PeerFailureError`` naming this rank and
        ``reason``. Called on an uncaught exception, before the interpreter exits."""
        self._announce(reason)

    def _announce(self, failure: str | None) -> None:
        kind = NoticeKind.SHUTDOWN if failure is None else NoticeKind.FAILURE
        self._lifecycle.announce(Notice(kind, self.rank, failure or ""))
        self._queue.wake_up()

    def _peer_lost(self, rank: int, reason: str) -> None:
        """The watchdog's verdict: the engine thread may be stuck in MPI for good."""
        error = PeerFailureError(rank, reason)
        logger.error("%s", error)
        self._lifecycle.lose_peer(rank, error)

    def leave_job(self) -> None:
        """At interpreter exit, after a failure stopped the engine: see
        :meth:`~baguahvd.engine.lifecycle.Lifecycle.leave_job`."""
        thread = self._thread
        self._lifecycle.leave_job(thread is not None and thread.is_alive())

    # ----------------------------------------------------------------------------------
    # Timeline (rank 0 writes; the other ranks accept the calls and do nothing)

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        if self.timeline is not None:
            self.timeline.start(path, mark_cycles)

    def stop_timeline(self) -> None:
        if self.timeline is not None:
            self.timeline.stop()

    # ----------------------------------------------------------------------------------
    # Submission (user threads)

    def submit(
        self,
        op: OpType,
        label: str,
        process_set_id: int,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None,
        name: str | None = None,
        reduce_op: ReduceOp = ReduceOp.SUM,
        prescale: float = 1.0,
        postscale: float = 1.0,
        root: int = -1,
        splits: Sequence[int] | None = None,
        payload: Sequence[int] = (),
        blocking: bool = False,
        fuse: bool = True,
    ) -> Handle:
        """Describes a collective once (its :class:`Request`), queues it, returns its handle.

        Args:
            op: the collective.
            label: Horovod's op name used in tensor names (``allreduce``,
                ``grouped_allgather``...).
            process_set_id: a registered process set this rank belongs to.
            inputs: the tensors to send (already validated: contiguous, supported dtype).
            outputs: preallocated outputs where their shape is known, else None.
            name: the user's name; unnamed requests pair by their order per process set.
            reduce_op, prescale, postscale, root, splits, payload, fuse: as
                :class:`~baguahvd.engine.messages.RequestMeta` documents them.
            blocking: the caller waits for the handle right away: the engine thread is
                woken when it does, once, rather than at the submission too.
        """
        stopped = self._lifecycle.error
        if stopped is not None:
            raise stopped
        state = self.process_sets.get(process_set_id)
        if state is None or not state.member:
            raise ProcessSetError(not_member_message(label, state, self.rank))
        dtype, shapes, device = describe_tensors(inputs, label)
        key, display, site = self._queue.name(op, label, process_set_id, name)
        # Positional: the per-request path of every small collective.
        meta = RequestMeta(
            key, display, op, process_set_id, self.rank, dtype, shapes, device,
            reduce_op if type(reduce_op) is ReduceOp else ReduceOp(reduce_op),
            float(prescale), float(postscale), root,
            None if splits is None else tuple(int(s) for s in splits), tuple(payload), "",
            site, fuse,
        )
        request = Request(meta, inputs, outputs, self._activity.name)
        if len(state.ranks) == 1:
            self._queue.check_unique(request)
            self._dispatch.run_alone(request, state)
            return request.handle
        # Single-member sets run here, in this thread's stream order: nothing to mark.
        self._dispatch.mark(request)
        self._queue.put(request, self._lifecycle.stop_error, blocking)
        return request.handle

    def take_place(
        self, op: OpType, label: str, process_set_id: int, name: str | None, reason: str
    ) -> None:
        """Submits a placeholder for a collective that failed its local checks on this rank.

        The caller raises the error itself; the placeholder (no tensors, ``reason`` as its
        ``failure``) stands for the collective in negotiation, so the other members'
        matching collective fails with ``reason`` and this rank's later unnamed collectives
        keep pairing with theirs. Its handle is dropped: nobody waits for it. Nothing is
        submitted where there is nothing to pair with: a stopped engine, a set this rank is
        not a member of, a set of one rank.

        Args:
            op, label, process_set_id, name: as the failed call would have given :meth:`submit`.
            reason: ``Type: message`` of the local error.

        Raises:
            DuplicateNameError: ``name`` is in flight on this rank (the earlier request
                takes the place).
        """
        state = self.process_sets.get(process_set_id)
        if not self.running or state is None or not state.member or len(state.ranks) == 1:
            return
        key, display, site = self._queue.name(op, label, process_set_id, name)
        meta = RequestMeta(key, display, op, process_set_id, self.rank, failure=reason, site=site)
        self._queue.put(Request(meta, (), None), self._lifecycle.stop_error)

    @property
    def fusion_bytes(self) -> int:
        """Bytes this rank has copied into and out of fusion buffers since it started."""
        return self._dispatch.fusion_bytes.value

    @property
    def full_negotiations(self) -> int:
        """Cycles whose requests went to rank 0 in full; the others ran from the response
        cache (or had nothing to run)."""
        return self._negotiation.exchanges

    # ----------------------------------------------------------------------------------
    # The engine thread

    def _run(self) -> None:
        _tighten_timer_slack()
        torch.set_grad_enabled(False)  # for this thread: collectives write raw buffers
        if self.config.thread_affinity:
            cores = self.config.thread_affinity
            try:
                os.sched_setaffinity(0, {cores[self.rank % len(cores)]})
            except (AttributeError, OSError) as exc:
                logger.warning("could not pin the engine thread: %s", exc)
        lifecycle = self._lifecycle
        queue = self._queue
        pending = self._dispatch.pending
        try:
            while lifecycle.error is None:
                cycle_ms = self.settings.cycle_time_ms
                # While requests are in flight, the next cycle starts at once: peers are
                # waiting for this rank to announce what it has; an idle job pauses longer.
                # Meanwhile, device units launched earlier complete as they finish.
                pause = self._negotiation.pause_s(cycle_ms)
                pending.wait(queue.wake, pause)
                queue.wake.clear()
                queue.let_burst_finish(cycle_ms)
                if not self._cycle():
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
            if self._watchdog is not None:
                self._watchdog.stop()

    def _cycle(self) -> bool:
        """One negotiation round; returns False once the job is shutting down."""
        self.cycles += 1
        new = self._queue.take()
        lifecycle = self._lifecycle
        notice = lifecycle.notice
        negotiation = self._negotiation
        if new:
            self.inject_fault("admit", new)
            negotiation.admit_all(new)
        now = time.monotonic()
        if self._inspector.due(now) and (stall := negotiation.check_stalls(now)) is not None:
            lifecycle.announce(stall)
        words = negotiation.announcement(notice, busy=len(self._dispatch.pending) > 0)
        # From here until the cycle ends, ranks are in the middle of the same exchange.
        lifecycle.begin_cycle()
        agreed = self.control.bitwise_and(words, self._waiting)
        if negotiation.end_agreed(agreed):
            # Some rank announced the end of the job: this cycle runs nothing, and the
            # device units every rank launched finish first.
            self._dispatch.pending.drain()
            decision = negotiation.negotiate(notice)
            final = decision.notice or Notice(NoticeKind.SHUTDOWN, -1)
            lifecycle.stop(final.error(self.rank), abnormal=final.abnormal)
            lifecycle.end_cycle()
            return False
        entries = negotiation.cached_work(agreed)
        negotiated: list[Entry] = []
        if negotiation.exchange_agreed(agreed):
            negotiated = negotiation.answered(negotiation.negotiate(None).responses)
            entries += negotiated
        for response, own in negotiated:
            if own is None:
                # Ran (or failed) while this rank had joined: count it, before the join can
                # return, so that this rank's next unnamed collective pairs with the others'.
                self._queue.skip_unnamed(response.process_set_id, response.key)
        self._executing = [request for _, request in entries if request is not None]
        timeline = self.timeline
        if timeline is not None and timeline.active and entries:
            timeline.cycle_started()
            for response, own in entries:
                if own is not None:
                    timeline.queued(response.name, response.op, own.activity)
        self.inject_fault("run", entries)
        for unit in plan_fusion(
            entries, self.settings.fusion_threshold, self.config.disable_group_fusion,
            unfused_sizes(self.process_sets, self.config.unfused_bytes),
        ):
            try:
                self._dispatch.run_unit(unit)
            except Exception as exc:
                raise CollectiveFailure(unit, exc) from exc
            response = unit[0][0]
            if response.op == OpType.REMOVE_PROCESS_SET and response.error is None:
                self._forget_process_set(response.payload[0])
        self._executing = []
        for response, own in negotiated:
            negotiation.remember(response, own)
        self._queue.release_retries()
        if self._tuner is not None and not self._tuner.frozen:
            proposal = self._tuner.record(_reduced(entries))
            if proposal is not None:
                negotiation.propose(proposal)
        lifecycle.end_cycle()
        agreed_settings = negotiation.take_agreed_settings()
        if agreed_settings is not None:
            # Every rank got these in this cycle's decision: all switch between this cycle
            # and the next.
            self.settings = agreed_settings
            self.settings_changes.append((self.cycles, agreed_settings))
            if self._tuner is not None:
                self._tuner.applied(agreed_settings)
        return True

    def inject_fault(self, stage: str, work: Sequence[object]) -> None:
        """The one seam for fault-injection tests; does nothing. The engine thread calls it
        with ``"admit"`` and the requests it takes from the queue, before negotiating them
        (between cycles), and with ``"run"`` and the cycle's agreed work ((response,
        request) pairs) before fusing and running it (mid-cycle). A test replaces it with a
        function that raises, to see how the ranks end a job whose engine fails there."""

    def _waiting(self) -> None:
        """Called while the engine thread waits for the other ranks in a negotiation: gives
        up once the engine has stopped (a peer's alarm, a lost peer), so the thread ends."""
        if not self.control.threads_multiple:
            self._lifecycle.check_alarm()
        if self._lifecycle.error is not None:
            raise _Abandoned

    def _internal_error(self, exc: BaseException) -> None:
        """A bug in the engine: fail this rank's requests and make sure the others do not
        wait for it forever."""
        logger.exception("the engine stopped after an internal error")
        reason = f"baguahvd engine failed: {describe_exception(exc)}"
        lifecycle = self._lifecycle
        error = PeerFailureError(self.rank, reason)
        if lifecycle.state is not State.IDLE:
            # Mid-cycle (or stopped already), the peers may wait in an exchange this rank
            # will not finish: tell them with an alarm; shutdown() waits for it to go out.
            lifecycle.leave(error)
        else:
            lifecycle.stop(error, abnormal=True)
            # Between cycles every rank is at the same point of the protocol: announce the
            # failure in one more cycle, as an uncaught exception would.
            try:
                self._negotiation.announce_end(Notice(NoticeKind.FAILURE, self.rank, reason))
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
        names = [response.name for response, _ in failure.unit]
        name = names[0] if len(names) == 1 else f"{names[0]} (fused with {len(names) - 1} more)"
        logger.error("%s failed on this rank; ending the job", name, exc_info=exc)
        reason = f"{name}: {describe_exception(exc)}"
        error = PeerFailureError(self.rank, reason)
        lifecycle = self._lifecycle
        lifecycle.leave()
        deliver([
            Outcome(request, error=keep_named(exc, error)) for _, request in failure.unit
            if request is not None and not request.handle.done()
        ], self.timeline)
        lifecycle.stop(error, abnormal=True)
        lifecycle.leave_mid_cycle(reason)

    def _fail_everything(self, error: BaseException) -> None:
        pending = [
            *self._queue.drain(), *self._negotiation.drain(), *self._executing,
            *self._dispatch.pending.requests(),
        ]
        for request in pending:
            if not request.handle.done():
                request.handle.fail(error)


def _reduced(entries: list[Entry]) -> list[tuple[str, int]]:
    """Name and bytes of this rank's allreduces among a cycle's entries (autotune's measure)."""
    return [
        (response.name, sum(t.numel() * t.element_size() for t in own.inputs))
        for response, own in entries
        if own is not None and response.op == OpType.ALLREDUCE and response.error is None
    ]


def _tighten_timer_slack() -> None:
    """Lets this thread's short sleeps end on time (Linux rounds them up by 50 us by
    default), which is most of a small collective's latency."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_timerslack = 29
        libc.prctl(pr_set_timerslack, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
