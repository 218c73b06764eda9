"""The engine: one background thread per process owns every collective call.

User threads call :meth:`Engine.submit`, which describes the call once (a
:class:`~baguahvd.engine.requests.Request`), queues it and returns its
:class:`~baguahvd.engine.requests.Handle`. Each cycle the engine thread

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
:mod:`~baguahvd.engine.negotiation.stall` inspector) ends the job in the next cycle with a
:mod:`~baguahvd.engine.notices` notice that every rank turns into the same error; a peer
that dies or freezes is noticed by the :mod:`~baguahvd.engine.lifecycle.watchdog`. A rank
that fails in the middle of a cycle (a collective that raises on this rank only: no memory
for the fusion buffer, a backend error) cannot wait for the next one, since its peers may be
blocked in a collective it will never join: it sends the notice as an alarm outside the
protocol (see :meth:`~baguahvd.engine.lifecycle.states.Lifecycle.leave_mid_cycle`). Rank 0
records what happens in the :mod:`~baguahvd.engine.timeline` when HOROVOD_TIMELINE is set.

This module builds the parts and holds what user threads call (submission, start, shutdown,
failure); the engine thread's cycle is :mod:`~baguahvd.engine.loop`'s, which asks the parts
and acts on what they return.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from baguahvd.backends.base import ControlPlane, DeviceCommFactory
from baguahvd.common.config import Config
from baguahvd.common.exceptions import (
    PeerFailureError,
    ProcessSetError,
    ShutDownError,
)
from baguahvd.common.ops import ReduceOp
from baguahvd.engine import submission
from baguahvd.engine.autotune import Settings
from baguahvd.engine.clock import SYSTEM_CLOCK, Clock
from baguahvd.engine.execution.dispatch import Dispatcher
from baguahvd.engine.intake import RequestQueue
from baguahvd.engine.lifecycle.states import Lifecycle, State
from baguahvd.engine.lifecycle.watchdog import Watchdog, process_identity
from baguahvd.engine.loop import EngineLoop
from baguahvd.engine.messages import (
    DTYPE_NAMES,
    GLOBAL_PROCESS_SET_ID,
    OpType,
    RequestMeta,
    dtype_name,
)
from baguahvd.engine.notices import Notice, NoticeKind
from baguahvd.engine.process_sets import ProcessSetRegistry, not_member_message
from baguahvd.engine.requests import Handle, Request
from baguahvd.engine.submission import Submissions, ThreadActivity
from baguahvd.engine.timeline import Timeline
from baguahvd.engine.views import View

__all__ = ["GLOBAL_PROCESS_SET_ID", "Engine"]

logger = logging.getLogger("baguahvd.engine")
_JOIN = OpType.JOIN  # a member looked up on its class costs as much as a dict lookup
_new_tuple = tuple.__new__


class Engine:
    """Negotiates, fuses and runs the collectives of this process (see module docstring).

    Args:
        config: the job's configuration.
        control: the negotiation channel over every rank of the job.
        device_comms: makes a process set's device (GPU) communicator from its data
            communicator; without it, GPU collectives fail.
        clock: what the engine thread's pauses between cycles are waited on.
    """

    def __init__(
        self,
        config: Config,
        control: ControlPlane,
        device_comms: DeviceCommFactory | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config = config
        self.control = control
        self.rank = control.rank
        self.size = control.size
        self._registry = ProcessSetRegistry(self.rank, self.size, control)
        self.process_sets = self._registry.states
        self._queue = RequestQueue()
        self._submissions = Submissions(config.check_call_sites)
        self._lifecycle = Lifecycle(self.rank, self.size, control, config.exit_timeout_s)
        self._thread: threading.Thread | None = None
        self._watchdog: Watchdog | None = None
        self.timeline = (
            Timeline(config.timeline_start_step, config.timeline_end_step)
            if config.timeline and self.rank == 0
            else None
        )
        """Rank 0's timeline when HOROVOD_TIMELINE is set (written only while started)."""
        self._dispatch = Dispatcher(
            self.rank, self.process_sets, self.timeline, device_comms,
            registry=self._registry, device_timeout_s=config.nccl_timeout_s,
            stopped=self._lifecycle.stop_error, single_rank_nccl=config.nccl_single_rank,
            nccl_average=config.nccl_average, submissions=self._submissions,
        )
        self._loop = EngineLoop(
            config, control, self.process_sets, self._queue, self._submissions, self._lifecycle,
            self._dispatch, self.timeline, clock,
        )
        self.settings_changes = self._loop.settings_changes
        """Autotune: (cycle, settings) of every change, the cycle being the last one run
        under the previous settings; the same on every rank (the engine thread appends)."""
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

    # ----------------------------------------------------------------------------------
    # Lifecycle

    running = View[bool]("_lifecycle.running")
    """Whether collectives are still accepted: the engine has not stopped."""
    abnormal = View[bool]("_lifecycle.abnormal")
    """Whether the engine stopped because something failed (see :meth:`leave_job`)."""
    state = View[State]("_lifecycle.state")
    """The lifecycle state (:class:`~baguahvd.engine.lifecycle.State`)."""
    cycles = View[int]("_loop.cycles")
    """Cycles this rank's engine thread has begun."""
    full_negotiations = View[int]("_loop.negotiation.exchanges")
    """Cycles whose requests went to rank 0 in full; the others ran from the response
    cache (or had nothing to run)."""
    fusion_bytes = View[int]("_dispatch.fusion_bytes.value")
    """Bytes this rank has copied into and out of fusion buffers since it started."""
    settings = View[Settings]("_loop.settings")
    """The fusion threshold and cycle time in use (autotune changes them)."""

    @property
    def autotuning(self) -> bool:
        """Whether this rank's autotune (rank 0's) still searches the fusion threshold and
        cycle time."""
        tuner = self._loop.tuner
        return tuner is not None and not tuner.frozen

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
        # thread between its waits in the negotiation (EngineLoop._give_up_if_stopped), which
        # it cannot do while it is blocked in a data collective.
        self._watchdog = Watchdog(
            self.rank, identities, lambda: self._loop.cycles, self._peer_lost,
            self.config.peer_timeout_s,
            poll=self._check_alarm if self.control.threads_multiple else None,
            failed=self.control.collective_failed,
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
        self._fail_pending()
        if self.timeline is not None:
            self.timeline.close()
        if self._loop.tuner is not None:
            self._loop.tuner.close()

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
        self._fail_pending()

    def _check_alarm(self) -> None:
        """The watchdog's look for a peer's alarm (see Lifecycle.check_alarm)."""
        if self._lifecycle.check_alarm():
            self._fail_pending()

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
        if state is None or state.comm is None:  # not ``member``: a property costs a call
            raise ProcessSetError(not_member_message(label, state, self.rank))
        # Per request, so the common cases inline (each call costs as much as its work):
        # one CPU tensor, a named collective.
        first = inputs[0] if len(inputs) == 1 else None
        if first is not None and not first.is_cuda:
            dtype = DTYPE_NAMES.get(first.dtype) or dtype_name(first.dtype)
            shapes = submission.ONE_SHAPE.get(first.shape) or submission.one_shape(first.shape)
            device = "CPU"
        else:
            dtype, shapes, device = submission.describe_tensors(inputs, label)
        if name is not None and op is not _JOIN:
            key = display = f"{label}.{name}"
            site = ""
        else:
            key, display, site = self._submissions.name(op, label, process_set_id, name)
        # Every field in order, without NamedTuple's __new__ (twice the cost).
        meta = _new_tuple(RequestMeta, (
            key, display, op, process_set_id, self.rank, dtype, shapes, device,
            reduce_op if type(reduce_op) is ReduceOp else ReduceOp(reduce_op),
            float(prescale), float(postscale), root,
            None if splits is None else tuple(int(s) for s in splits), tuple(payload), "",
            site, fuse,
        ))
        request = Request(meta, inputs, outputs, self._activity.name)
        if len(state.ranks) == 1:
            self._queue.check_unique(request)
            self._dispatch.run_alone(request, state)
            return request.handle
        # Only this thread knows its current stream: noted now, read by the engine thread.
        # (Single-member sets run here, in this thread's stream order: nothing to mark.)
        if device != "CPU" or op == _JOIN:
            self._submissions.mark(request)
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
        key, display, site = self._submissions.name(op, label, process_set_id, name)
        meta = RequestMeta(key, display, op, process_set_id, self.rank, failure=reason, site=site)
        self._queue.put(Request(meta, (), None), self._lifecycle.stop_error)

    def _run(self) -> None:
        try:
            self._loop.run()
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()

    def _fail_pending(self) -> None:
        self._loop.fail_pending()
