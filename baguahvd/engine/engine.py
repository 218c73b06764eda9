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
``Engine._let_burst_finish``), or after ``cycle_time_ms`` otherwise.
Process sets with a single member never leave the calling thread.

Nothing waits forever. A rank that shuts down, fails (an uncaught exception, a broken
engine) or whose collectives stall past the shutdown time (rank 0's
:mod:`~baguahvd.engine.stall` inspector) ends the job in the next cycle with a
:mod:`~baguahvd.engine.notices` notice that every rank turns into the same error; a peer
that dies or freezes is noticed by the :mod:`~baguahvd.engine.watchdog`. A rank that fails
in the middle of a cycle (a collective that raises on this rank only: no memory for the
fusion buffer, a backend error) cannot wait for the next one, since its peers may be blocked
in a collective it will never join: it sends the notice as an alarm outside the protocol
(see :meth:`Engine._leave_mid_cycle`). Rank 0 records what happens in the
:mod:`~baguahvd.engine.timeline` when HOROVOD_TIMELINE is set.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from baguahvd.backends.base import (
    Communicator,
    ControlPlane,
    DeviceCommFactory,
    SelfCommunicator,
)
from baguahvd.common.config import Config
from baguahvd.common.exceptions import (
    DuplicateNameError,
    HorovodInternalError,
    MismatchError,
    PeerFailureError,
    ProcessSetError,
    ShutDownError,
)
from baguahvd.common.ops import ReduceOp
from baguahvd.engine import execute
from baguahvd.engine.cache import Lookup, ResponseCache
from baguahvd.engine.messages import OpType, RequestMeta, Response, build_response
from baguahvd.engine.notices import (
    Decision,
    Notice,
    NoticeKind,
    RankReport,
    describe_exception,
    first_notice,
)
from baguahvd.engine.requests import Handle, Request
from baguahvd.engine.stall import StallInspector
from baguahvd.engine.timeline import Timeline, transport_activity
from baguahvd.engine.watchdog import Watchdog, process_identity

logger = logging.getLogger("baguahvd.engine")

GLOBAL_PROCESS_SET_ID = 0
_JOIN_KEY = "join"
# A burst of submissions is over once its thread has submitted nothing for this long
# (see _let_burst_finish) ...
_QUIET_S = 5e-4
# ... or this many cycle times after it began, whichever comes first.
_BURST_CYCLES = 5
# Flag bits of the last byte of the negotiation vector; a cleared bit means "yes".
_FLAG_NOTHING_TO_SEND = 1
_FLAG_NO_SHUTDOWN = 2


class _CollectiveFailure(Exception):
    """A unit of agreed collectives raised on this rank while it ran (engine thread)."""

    def __init__(self, unit: list[tuple[Response, Request | None]], error: Exception) -> None:
        super().__init__(str(error))
        self.unit = unit
        self.error = error


class _Abandoned(Exception):
    """The engine thread stops waiting for its peers: the job is ending."""


@dataclasses.dataclass
class ProcessSetState:
    """A registered process set as the engine sees it."""

    id: int
    ranks: tuple[int, ...]
    """Global ranks, sorted."""
    comm: Communicator | None
    """Communicator of the members; None on ranks outside the set."""
    device_comm: Communicator | None = None
    """NCCL communicator of the members, created at the set's first GPU collective."""

    def includes(self, rank: int) -> bool:
        return rank in self.ranks

    @property
    def member(self) -> bool:
        """Whether this rank belongs to the set (only members hold a communicator)."""
        return self.comm is not None

    def set_rank(self, rank: int) -> int:
        return self.ranks.index(rank)


class _Coordinator:
    """Rank 0's table of requests that not every member has submitted yet."""

    def __init__(self, inspector: StallInspector, timeline: Timeline | None) -> None:
        self.table: dict[tuple[int, str], dict[int, RequestMeta]] = {}
        self.joined: list[int] = []
        self.inspector = inspector
        self.timeline = timeline

    def decide(
        self,
        reports: Sequence[RankReport],
        process_sets: dict[int, ProcessSetState],
        world_size: int,
    ) -> Decision:
        """Rank 0's answer to the cycle's reports: the collectives every member has now
        submitted or, when a rank announced the end of the job, that end alone."""
        notice = first_notice(report.notice for report in reports)
        if notice is not None:
            return Decision([], (), notice)
        now = time.monotonic()
        for report in reports:
            self.add(report.metas, report.waited, now)
        return Decision(self.ready(process_sets, world_size), tuple(self.joined))

    def add(self, metas: Sequence[RequestMeta], waited: Sequence[float], now: float) -> None:
        timeline = self.timeline if self.timeline is not None and self.timeline.active else None
        for meta, age in zip(metas, waited):
            ident = (meta.process_set_id, meta.key)
            if meta.op == OpType.JOIN:
                if meta.rank not in self.joined:
                    self.joined.append(meta.rank)
                continue
            self.table.setdefault(ident, {})[meta.rank] = meta
            self.inspector.seen(ident, now - age)
            if timeline is not None:
                timeline.negotiation_started(meta.name, meta.op)
                timeline.rank_ready(meta.name, meta.rank)

    def ready(
        self, process_sets: dict[int, ProcessSetState], world_size: int
    ) -> list[Response]:
        responses = []
        joined = set(self.joined)
        for ident in list(self.table):
            submitted = self.table[ident]
            process_set = process_sets.get(ident[0])
            if process_set is None:
                metas = list(submitted.values())
                responses.append(
                    Response(
                        key=metas[0].key,
                        name=metas[0].name,
                        op=metas[0].op,
                        process_set_id=ident[0],
                        error=f"{metas[0].name}: process set {ident[0]} was removed.",
                    )
                )
                self._forget(ident)
                continue
            missing = [r for r in process_set.ranks if r not in submitted and r not in joined]
            if missing:
                continue
            metas = [submitted[r] for r in process_set.ranks if r in submitted]
            absent = tuple(r for r in process_set.ranks if r not in submitted)
            responses.append(build_response(metas, process_set.ranks, absent))
            self._forget(ident)
        if len(self.joined) == world_size:
            responses.append(
                Response(
                    key=_JOIN_KEY,
                    name="join",
                    op=OpType.JOIN,
                    process_set_id=GLOBAL_PROCESS_SET_ID,
                    last_joined=self.joined[-1],
                )
            )
            self.joined = []
        if self.timeline is not None and self.timeline.active:
            for response in responses:
                self.timeline.negotiation_ended(response.name, response.op)
        return responses

    def _forget(self, ident: tuple[int, str]) -> None:
        del self.table[ident]
        self.inspector.forget(ident)

    def check_stalls(
        self, process_sets: dict[int, ProcessSetState], now: float
    ) -> Notice | None:
        """Reports stalled requests; returns the notice that ends the job past the stall
        shutdown time."""
        if not self.table:
            return None
        return self.inspector.check(self.table, process_sets, self.joined, now)


class Engine:
    """Negotiates, fuses and runs the collectives of this process (see module docstring)."""

    def __init__(
        self,
        config: Config,
        control: ControlPlane,
        device_comms: DeviceCommFactory | None = None,
    ) -> None:
        """
        Args:
            config: the job's configuration.
            control: the negotiation channel over every rank of the job.
            device_comms: makes a process set's device (GPU) communicator from its data
                communicator; without it, GPU collectives fail.
        """
        self.config = config
        self.control = control
        self.device_comms = device_comms
        self.rank = control.rank
        self.size = control.size
        self.process_sets: dict[int, ProcessSetState] = {
            GLOBAL_PROCESS_SET_ID: ProcessSetState(
                GLOBAL_PROCESS_SET_ID,
                tuple(range(self.size)),
                control.create_group_comm(range(self.size))
                if self.size > 1
                else SelfCommunicator(),
            )
        }
        self._next_process_set_id = 1
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._flush = threading.Event()
        """Set when a thread blocks on a handle: the burst being submitted is over."""
        self._queue: list[Request] = []
        self._inflight: set[tuple[int, str]] = set()
        self._noname: dict[int, int] = {}
        self._last_arrival = 0.0
        self._notice: Notice | None = None
        """This rank's announcement of the end of the job, sent in the next cycle."""
        self._stopped: BaseException | None = None
        self.abnormal = False
        """Whether the engine stopped because something failed (see :meth:`leave_job`)."""
        self._leaving = False
        """Whether the engine thread is telling the peers that this rank failed."""
        self._mpi_stuck: str | None = None
        """Why this rank's MPI calls cannot all complete (a peer is gone or left a
        collective unfinished): leaving the job must then end it with MPI_Abort."""
        self._thread: threading.Thread | None = None
        self._watchdog: Watchdog | None = None
        self.timeline = (
            Timeline(config.timeline_start_step, config.timeline_end_step)
            if config.timeline and self.rank == 0
            else None
        )
        """Rank 0's timeline when HOROVOD_TIMELINE is set (written only while started)."""
        # Engine-thread state.
        self._cache = ResponseCache(config.cache_capacity)
        self._waiting_on_cache: dict[int, Request] = {}
        self._stale_slots: set[int] = set()
        self._to_send: list[Request] = []
        self._sent: dict[tuple[int, str], Request] = {}
        self._join_mode = False
        self._buffers = execute.FusionBuffers()
        self._executing: list[Request] = []
        self._in_cycle = False
        self._inspector = StallInspector(
            config.stall_check_time_s, config.stall_shutdown_time_s, config.stall_check_disable
        )
        self._coordinator = (
            _Coordinator(self._inspector, self.timeline) if self.rank == 0 else None
        )
        self.cycles = 0

    # ----------------------------------------------------------------------------------
    # Process sets

    def register_process_set(self, ranks: Sequence[int]) -> int:
        """Registers a process set collectively; call on every rank in the same order before
        :meth:`start` (static sets) or through an ADD_PROCESS_SET request (dynamic)."""
        ranks = tuple(sorted(ranks))
        comm: Communicator | None
        if len(ranks) == 1:
            comm = SelfCommunicator() if ranks[0] == self.rank else None
        else:
            comm = self.control.create_group_comm(ranks)
        ident = self._next_process_set_id
        self._next_process_set_id += 1
        self.process_sets[ident] = ProcessSetState(ident, ranks, comm)
        return ident

    def _remove_process_set(self, ident: int) -> None:
        state = self.process_sets.pop(ident, None)
        if state is not None and state.device_comm is not None:
            state.device_comm.free()
        if state is not None and state.comm is not None:
            state.comm.free()
        self._cache.evict_process_set(ident)
        # Requests that were waiting on the removed set's cached responses can never run.
        for slot, request in list(self._waiting_on_cache.items()):
            if request.meta.process_set_id == ident:
                del self._waiting_on_cache[slot]
                self._finish(
                    request,
                    error=HorovodInternalError(
                        f"{request.meta.name}: process set {ident} was removed."
                    ),
                )

    # ----------------------------------------------------------------------------------
    # Lifecycle

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
        # Alarms are looked for by the watchdog when MPI lets a second thread in while
        # the engine thread waits inside a collective; otherwise only by the engine thread
        # (see _waiting), which cannot while it is blocked in a data collective.
        self._watchdog = Watchdog(
            self.rank, identities, lambda: self.cycles, self._peer_lost,
            self.config.peer_timeout_s,
            poll=self._check_alarm if self.control.threads_multiple else None,
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
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            deadline = time.monotonic() + timeout
            # A failure noticed meanwhile (a dead peer) may leave the thread stuck in MPI;
            # one that is telling the peers of this rank's failure ends in bounded time.
            while (thread.is_alive() and time.monotonic() < deadline
                   and (not self.abnormal or self._leaving)):
                thread.join(0.05)
            if thread.is_alive() and not self.abnormal:
                logger.warning(
                    "the engine thread did not stop within %.0f s (a peer may have died)",
                    timeout,
                )
        if self._watchdog is not None:
            self._watchdog.stop()
        self._stop(ShutDownError())
        if self.timeline is not None:
            self.timeline.close()

    def fail(self, reason: str) -> None:
        """Ends the job because this rank failed, without waiting: every other rank's
        pending and later collectives raise ``PeerFailureError`` naming this rank and
        ``reason``. Called on an uncaught exception, before the interpreter exits."""
        self._announce(reason)

    def _announce(self, failure: str | None) -> None:
        with self._lock:
            if self._notice is None and self._stopped is None:
                kind = NoticeKind.SHUTDOWN if failure is None else NoticeKind.FAILURE
                self._notice = Notice(kind, self.rank, failure or "")
        self._wake.set()
        self._flush.set()

    def _stop(self, error: BaseException, abnormal: bool = False) -> None:
        """Fails every pending and later request with ``error`` (the first error wins)."""
        with self._lock:
            if self._stopped is None:
                self._stopped = error
            self.abnormal = self.abnormal or abnormal
            stopped = self._stopped
        self._fail_everything(stopped)

    def _peer_lost(self, rank: int, reason: str) -> None:
        """The watchdog's verdict: the engine thread may be stuck in MPI for good."""
        error = PeerFailureError(rank, reason)
        logger.error("%s", error)
        self._mpi_stuck = "a peer is gone"
        self._stop(error, abnormal=True)

    def _check_alarm(self) -> None:
        """Turns a peer's alarm (see :meth:`_leave_mid_cycle`) into this rank's error and
        acknowledges it. Called by the watchdog thread, or by the engine thread while it
        waits."""
        alarm = self.control.poll_alarm()
        if alarm is None:
            return
        source, notice = alarm
        self.control.acknowledge(source)
        error = notice.error(self.rank)
        logger.error("%s", error)
        # This rank's engine thread may be blocked in a collective the sender never joins.
        self._mpi_stuck = f"rank {source} left a collective unfinished"
        self._stop(error, abnormal=True)

    def leave_job(self) -> None:
        """At interpreter exit, after a failure stopped the engine: waits up to
        ``exit_timeout_s`` for every rank to get here too, then lets MPI finalize; ends the
        whole job with MPI_Abort instead when some rank does not come (it is stuck, asleep
        or dead: MPI_Finalize would wait for it forever)."""
        if not self.abnormal or self.size == 1:
            return
        thread = self._thread
        if self._mpi_stuck is not None or (thread is not None and thread.is_alive()):
            self._abort(f"{self._mpi_stuck or 'the engine thread is stuck'}, so MPI cannot "
                        "finish")
        elif not self.control.exit_barrier(self.config.exit_timeout_s):
            self._abort(
                f"not every rank exited within {self.config.exit_timeout_s:g} s of the "
                "failure (BAGUAHVD_EXIT_TIMEOUT_SECONDS)"
            )

    def _abort(self, why: str) -> None:
        logger.error("ending the job with MPI_Abort: %s", why)
        for handler in logging.getLogger("baguahvd").handlers:
            handler.flush()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self.control.abort(1)

    @property
    def running(self) -> bool:
        return self._stopped is None

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
    ) -> Handle:
        """Queues a collective and returns its handle.

        Args:
            op: the collective.
            label: Horovod's op name used in tensor names (``allreduce``,
                ``grouped_allgather``...).
            process_set_id: a registered process set this rank belongs to.
            inputs: the tensors to send (already validated: contiguous, supported dtype).
            outputs: preallocated outputs where their shape is known, else None.
            name: the user's name; unnamed requests are matched by their order per process
                set.
            root: broadcast root as a rank of the process set.
            splits: alltoall splits (dim-0 slices per member).
        """
        stopped = self._stopped
        if stopped is not None:
            raise stopped
        state = self.process_sets.get(process_set_id)
        if state is None or not state.member:
            raise ProcessSetError(_not_member_message(label, state, self.rank))
        if name is not None and op != OpType.JOIN:
            key = display = f"{label}.{name}"
        elif op == OpType.JOIN:
            key = display = _JOIN_KEY
        else:
            with self._lock:
                count = self._noname.get(process_set_id, 0)
                self._noname[process_set_id] = count + 1
            key = f"noname.{count}"
            display = f"{label}.noname.{count}"
        if inputs:
            first = inputs[0]
            dtype = _DTYPE_NAMES.get(first.dtype) or execute.dtype_name(first.dtype)
            shapes = (tuple(first.shape),) if len(inputs) == 1 else tuple(
                tuple(t.shape) for t in inputs
            )
            # The kind only, as Horovod compares it: each rank drives its own GPU (usually
            # cuda:<local_rank>), so indices differ across ranks of one collective.
            device = "GPU" if first.is_cuda else "CPU"
        else:
            dtype, shapes, device = "", (), "CPU"
        # Positional: the per-request path of every small collective.
        meta = RequestMeta(
            key,
            display,
            op,
            process_set_id,
            self.rank,
            dtype,
            shapes,
            device,
            reduce_op if type(reduce_op) is ReduceOp else ReduceOp(reduce_op),
            float(prescale),
            float(postscale),
            root,
            None if splits is None else tuple(int(s) for s in splits),
            tuple(payload),
        )
        request = Request(meta, inputs, outputs)
        ident = request.ident
        if len(state.ranks) == 1:
            with self._lock:
                if ident in self._inflight:
                    raise DuplicateNameError(display)
            self._run_alone(request, state)
            return request.handle
        request.handle.on_wait = self._flush.set
        with self._lock:
            if self._stopped is not None:
                raise self._stopped
            if ident in self._inflight:
                raise DuplicateNameError(display)
            self._inflight.add(ident)
            queue = self._queue
            queue.append(request)
            self._last_arrival = time.perf_counter()
        # The engine takes the whole queue at once: only the first request of a batch needs
        # to wake it (see _let_burst_finish for the rest).
        if len(queue) == 1:
            self._wake.set()
        return request.handle

    def _run_alone(self, request: Request, state: ProcessSetState) -> None:
        """A single-member process set: no negotiation, no communication."""
        response = build_response([request.meta], state.ranks, ())
        if request.meta.op == OpType.JOIN:
            response = response._replace(last_joined=self.rank)
        comm = state.comm if state.comm is not None else SelfCommunicator()
        if self.timeline is not None and self.timeline.active:
            self.timeline.queued(response.name, response.op)
        try:
            self._execute([(response, request)], comm)
        except Exception as exc:  # noqa: BLE001 - reported through the handle
            logger.exception("%s failed", response.name)
            self._finish(request, error=_named(exc, response.name))

    # ----------------------------------------------------------------------------------
    # The engine thread

    def _run(self) -> None:
        _tighten_timer_slack()
        if self.config.thread_affinity:
            cores = self.config.thread_affinity
            try:
                os.sched_setaffinity(0, {cores[self.rank % len(cores)]})
            except (AttributeError, OSError) as exc:
                logger.warning("could not pin the engine thread: %s", exc)
        try:
            while self._stopped is None:
                # While requests are in flight, the next cycle starts at once: peers are
                # waiting for this rank to announce what it has.
                in_flight = self._sent or self._waiting_on_cache or self._to_send
                self._wake.wait(0.0 if in_flight else self.config.cycle_time_ms / 1000.0)
                self._wake.clear()
                self._let_burst_finish()
                if not self._cycle():
                    break
        except _Abandoned:
            pass
        except _CollectiveFailure as failure:
            self._collective_failed(failure)
        except BaseException as exc:  # noqa: BLE001 - the error is handed to every waiter
            self._internal_error(exc)
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()

    def _internal_error(self, exc: BaseException) -> None:
        """A bug in the engine: fail this rank's requests and make sure the others do not
        wait for it forever."""
        logger.exception("the engine stopped after an internal error")
        reason = f"baguahvd engine failed: {describe_exception(exc)}"
        in_step = not self._in_cycle
        # Mid-cycle, shutdown() waits for the alarm to go out (_leave_mid_cycle).
        self._leaving = not in_step
        self._stop(PeerFailureError(self.rank, reason), abnormal=True)
        if in_step:
            # Between cycles every rank is at the same point of the protocol: announce the
            # failure in one more cycle, as an uncaught exception would.
            try:
                self._announce_end(Notice(NoticeKind.FAILURE, self.rank, reason))
                return
            except BaseException:  # noqa: BLE001 - falls back to an alarm
                logger.exception("could not tell the other ranks in a cycle")
                self._leaving = True
        self._leave_mid_cycle(reason)

    def _collective_failed(self, failure: _CollectiveFailure) -> None:
        """A collective raised on this rank while it ran: this rank leaves the protocol (its
        peers may wait in that collective, or its data communicators are out of step with
        theirs), and every rank's pending and later collectives raise the error."""
        self._leaving = True
        exc = failure.error
        names = [response.name for response, _ in failure.unit]
        name = names[0] if len(names) == 1 else f"{names[0]} (fused with {len(names) - 1} more)"
        logger.error("%s failed on this rank; ending the job", name, exc_info=exc)
        reason = f"{name}: {describe_exception(exc)}"
        error = PeerFailureError(self.rank, reason)
        for _, request in failure.unit:
            if request is not None and not request.handle.done():
                # Named failures (an NCCL error or timeout) keep their class for ``except``.
                self._finish(request, error=exc if isinstance(exc, HorovodInternalError)
                             else error)
        self._stop(error, abnormal=True)
        self._leave_mid_cycle(reason)

    def _leave_mid_cycle(self, reason: str) -> None:
        """Leaves the protocol in the middle of a cycle, after this rank failed (its engine
        is stopped already).

        The peers may be blocked in a collective this rank will never join, or will be in
        the next negotiation, so a notice in the next cycle would never reach them. It goes
        to each of them as an alarm instead; their watchdog thread picks it up within a
        tenth of a second, acknowledges it and fails their collectives with
        ``PeerFailureError(this rank, reason)``. A peer that does not acknowledge within
        ``exit_timeout_s`` cannot hear it (its engine thread is blocked inside MPI and MPI
        lets no other thread in: HOROVOD_MPI_THREADS_DISABLE=1; or it is frozen): MPI_Abort
        then ends the job.
        """
        peers = [r for r in range(self.size) if r != self.rank]
        self.control.raise_alarm(Notice(NoticeKind.FAILURE, self.rank, reason), peers)
        deadline = time.monotonic() + self.config.exit_timeout_s
        missing = set(peers)
        while True:
            missing -= self.control.acknowledged()
            if not missing:
                return
            if time.monotonic() >= deadline:
                break
            # A peer that failed at the same time waits for this rank's acknowledgement.
            self._check_alarm()
            time.sleep(0.002)
        self._abort(
            f"ranks {sorted(missing)} did not acknowledge this rank's failure within "
            f"{self.config.exit_timeout_s:g} s (BAGUAHVD_EXIT_TIMEOUT_SECONDS); they are "
            "blocked in a collective it will not join"
        )

    def _waiting(self) -> None:
        """Called while the engine thread waits for the other ranks in a negotiation: gives
        up once the engine has stopped (a peer's alarm, a lost peer), so the thread ends."""
        if not self.control.threads_multiple:
            self._check_alarm()
        if self._stopped is not None:
            raise _Abandoned

    def _announce_end(self, notice: Notice) -> None:
        """Runs the announcing half of a cycle with nothing but ``notice`` in it."""
        span = (self._cache.capacity + 7) // 8
        flags = 0xFF & ~_FLAG_NOTHING_TO_SEND & ~_FLAG_NO_SHUTDOWN
        words = np.concatenate(
            [np.zeros(span, dtype=np.uint8), np.full(span, 0xFF, dtype=np.uint8),
             np.array([flags], dtype=np.uint8)]
        )
        self.control.bitwise_and(words)
        self._exchange(RankReport([], [], notice))

    def _let_burst_finish(self) -> None:
        """Waits for a burst of submissions (a backward pass, a loop of async calls) to end
        before negotiating it, so that it is fused into one cycle and the engine thread does
        not compete with the submitting thread for the GIL meanwhile.

        The burst is over at once when a thread starts waiting for a handle (it submits
        nothing more meanwhile: a blocking collective, ``synchronize``), else when nothing
        has been submitted for half a millisecond, and after five cycle times at the latest.
        The engine waits on the flush event, which such a thread sets (the cycle that takes
        the queue clears it), and wakes up only for those deadlines: every wake-up takes the
        GIL from the submitting thread.
        """
        if not self._queue:
            return
        start = time.perf_counter()
        limit = _BURST_CYCLES * self.config.cycle_time_ms / 1000.0
        flush = self._flush
        while not flush.is_set():
            now = time.perf_counter()
            since = now - self._last_arrival
            if since >= _QUIET_S or now - start >= limit:
                return
            flush.wait(min(_QUIET_S - since, limit - (now - start)))

    def _cycle(self) -> bool:
        """One negotiation round; returns False once the job is shutting down."""
        self.cycles += 1
        self._flush.clear()
        with self._lock:
            new, self._queue = self._queue, []
            notice = self._notice
        if new:
            self._admit_all(new)
        now = time.monotonic()
        if self._inspector.due(now):
            self._check_stalls(now)

        capacity = self._cache.capacity
        hits = self._cache.not_member.copy()
        if self._waiting_on_cache:
            hits[list(self._waiting_on_cache)] = True
        valid = np.ones(capacity, dtype=bool)
        if self._stale_slots:
            valid[list(self._stale_slots)] = False
            self._stale_slots.clear()
        flags = 0xFF
        if self._to_send or notice is not None:
            flags &= ~_FLAG_NOTHING_TO_SEND
        if notice is not None:
            flags &= ~_FLAG_NO_SHUTDOWN
        words = np.concatenate(
            [np.packbits(hits), np.packbits(valid), np.array([flags], dtype=np.uint8)]
        )
        # From here until the cycle ends, ranks are in the middle of the same exchange.
        self._in_cycle = True
        agreed = self.control.bitwise_and(words, self._waiting)
        span = (capacity + 7) // 8
        flags = int(agreed[-1])
        if not flags & _FLAG_NO_SHUTDOWN:
            # Some rank announced the end of the job: this cycle runs nothing.
            decision = self._negotiate(notice)
            final = decision.notice or Notice(NoticeKind.SHUTDOWN, -1)
            self._stop(final.error(self.rank), abnormal=final.abnormal)
            self._in_cycle = False
            return False
        ready = np.unpackbits(agreed[:span])[:capacity].astype(bool)
        still_valid = np.unpackbits(agreed[span : 2 * span])[:capacity].astype(bool)

        for slot in np.flatnonzero(~still_valid).tolist():
            ready[slot] = False
            self._cache.evict(slot)
            stale = self._waiting_on_cache.pop(slot, None)
            if stale is not None:
                self._to_send.append(stale)

        slots = np.flatnonzero(ready).tolist()
        waiting = self._waiting_on_cache.pop
        entries: list[tuple[Response, Request | None]] = [
            (response, waiting(slot, None))
            for slot, response in zip(slots, self._cache.take(slots))
        ]

        negotiated: list[Response] = []
        if not flags & _FLAG_NOTHING_TO_SEND:
            negotiated = self._negotiate(None).responses
            for response in negotiated:
                entries.append(
                    (response, self._sent.pop((response.process_set_id, response.key), None))
                )

        self._executing = [request for _, request in entries if request is not None]
        timeline = self.timeline
        if timeline is not None and timeline.active and entries:
            timeline.cycle_started()
            for response, own in entries:
                if own is not None:
                    timeline.queued(response.name, response.op)
        for unit in self._fuse(entries):
            try:
                self._execute_unit(unit)
            except Exception as exc:
                raise _CollectiveFailure(unit, exc) from exc
        self._executing = []
        for response, own in entries[len(entries) - len(negotiated) :]:
            self._remember(response, own)
        self._in_cycle = False
        return True

    def _check_stalls(self, now: float) -> None:
        # Requests waiting on cached responses are invisible to rank 0: after the warning
        # time, invalidate their entries so that they are negotiated in full.
        self._stale_slots.update(
            self._inspector.stale_cache_waits(self._waiting_on_cache, now)
        )
        if self._coordinator is None:
            return
        stall = self._coordinator.check_stalls(self.process_sets, now)
        if stall is not None:
            with self._lock:
                if self._notice is None:
                    self._notice = stall

    def _admit_all(self, requests: list[Request]) -> None:
        """:meth:`_admit` for a cycle's new requests, with the common case (a cache hit)
        inline."""
        cache = self._cache
        if self._join_mode or cache.capacity == 0:
            for request in requests:
                self._admit(request)
            return
        lookup = cache.lookup
        waiting = self._waiting_on_cache
        timeline = self.timeline
        traced = timeline is not None and timeline.active
        for request in requests:
            meta = request.meta
            if meta.op in _CACHEABLE and not meta.key.startswith("noname."):
                found, slot = lookup(meta.process_set_id, meta.key, meta.signature())
                if found is Lookup.HIT:
                    waiting[slot] = request
                    if traced:
                        assert timeline is not None
                        timeline.negotiation_started(meta.name, meta.op)
                    continue
            self._admit(request)

    def _admit(self, request: Request) -> None:
        meta = request.meta
        if (
            self._join_mode
            or self._cache.capacity == 0
            or meta.op not in _CACHEABLE
            or meta.key.startswith("noname.")
        ):
            self._to_send.append(request)
            return
        found, slot = self._cache.lookup(meta.process_set_id, meta.key, meta.signature())
        if found is Lookup.HIT:
            self._waiting_on_cache[slot] = request
            if self.timeline is not None and self.timeline.active:
                self.timeline.negotiation_started(meta.name, meta.op)
            return
        if found is Lookup.STALE:
            self._stale_slots.add(slot)
        self._to_send.append(request)

    def _negotiate(self, notice: Notice | None) -> Decision:
        now = time.monotonic()
        metas = [request.meta for request in self._to_send]
        waited = [now - request.submitted for request in self._to_send]
        for request in self._to_send:
            self._sent[(request.meta.process_set_id, request.meta.key)] = request
        self._to_send = []
        decision = self._exchange(RankReport(metas, waited, notice))
        join_mode = bool(decision.joined)
        if join_mode and not self._join_mode:
            # Cached announcements cannot count ranks that joined: renegotiate in full.
            self._to_send.extend(self._waiting_on_cache.values())
            self._waiting_on_cache.clear()
        self._join_mode = join_mode
        return decision

    def _exchange(self, report: RankReport) -> Decision:
        """Sends this rank's report to rank 0 and returns rank 0's decision."""
        gathered = self.control.gather(report)
        decision: Decision | None = None
        if self._coordinator is not None:
            assert gathered is not None
            decision = self._coordinator.decide(gathered, self.process_sets, self.size)
        result: Decision = self.control.broadcast(decision)
        return result

    def _remember(self, response: Response, request: Request | None) -> None:
        """Caches a negotiated response; every rank calls this for the same responses in the
        same order, so the caches stay identical."""
        if (
            response.error is not None
            or response.op not in _CACHEABLE
            or response.key.startswith("noname.")
            or response.joined
        ):
            return
        state = self.process_sets.get(response.process_set_id)
        if state is None:
            return
        signature = None if request is None else request.meta.signature()
        for slot in self._cache.put(response, signature, state.includes(self.rank)):
            # A request admitted as a hit on an entry that is now gone (ranks admit requests
            # in different cycles) must be negotiated in full, or it waits on a slot that
            # another name will reuse.
            waiting = self._waiting_on_cache.pop(slot, None)
            if waiting is not None:
                self._to_send.append(waiting)

    def _fuse(
        self, entries: list[tuple[Response, Request | None]]
    ) -> list[list[tuple[Response, Request | None]]]:
        threshold = self.config.fusion_threshold
        if threshold <= 0:
            return [[entry] for entry in entries]
        no_groups = self.config.disable_group_fusion
        units: list[list[tuple[Response, Request | None]]] = []
        # Per fusion key, the unit still open for more tensors and its bytes so far.
        open_units: dict[tuple[object, ...], tuple[list[tuple[Response, Request | None]], int]]
        open_units = {}
        prod = math.prod
        for entry in entries:
            response = entry[0]
            shapes = response.shapes
            if (
                response.op != _ALLREDUCE
                or response.error is not None
                or response.reduce_op == _ADASUM
                or (no_groups and len(shapes) > 1)
            ):
                units.append([entry])
                continue
            key = (
                response.process_set_id,
                response.dtype,
                response.reduce_op,
                response.prescale,
                response.postscale,
                response.device,
            )
            count = prod(shapes[0]) if len(shapes) == 1 else sum(map(prod, shapes))
            nbytes = count * _ITEMSIZES[response.dtype]
            found = open_units.get(key)
            if found is not None and found[1] + nbytes <= threshold:
                found[0].append(entry)
                open_units[key] = (found[0], found[1] + nbytes)
            else:
                unit = [entry]
                units.append(unit)
                open_units[key] = (unit, nbytes)
        return units

    def _execute_unit(self, unit: list[tuple[Response, Request | None]]) -> None:
        response = unit[0][0]
        state = self.process_sets.get(response.process_set_id)
        if state is None or state.comm is None:
            return
        if response.device != "CPU" and response.error is None:
            self._execute(unit, self._device_comm(state, state.comm))
            return
        self._execute(unit, state.comm)

    def _device_comm(self, state: ProcessSetState, comm: Communicator) -> Communicator:
        """The set's device communicator, created on first use: every member runs the agreed
        responses in the same order, so all of them create it in the same response."""
        if isinstance(comm, SelfCommunicator):
            return comm
        if state.device_comm is None:
            if self.device_comms is None:
                raise HorovodInternalError(
                    "this engine was built without device communicators; GPU tensors "
                    "cannot be reduced"
                )
            state.device_comm = self.device_comms(comm)
        return state.device_comm

    # Grad mode is per thread and on by default, here as in the user's thread (single-member
    # sets): the collectives write users' tensors as raw buffers, leaves that require grad
    # included, and their outputs must not join anyone's autograd graph.
    @torch.no_grad()
    def _execute(self, unit: list[tuple[Response, Request | None]], comm: Communicator) -> None:
        """Runs one unit (a fused group of allreduces, or one other collective) and
        completes its handles."""
        timeline = self.timeline
        if timeline is None or not timeline.active:
            self._execute_unit_on(unit, comm, None)
            return
        response = unit[0][0]
        traced = [request.meta.name for _, request in unit if request is not None]
        transport = transport_activity(response.op, response.device)

        def phase(activity: str) -> None:
            for name in traced:
                timeline.phase(name, transport if activity == "COMMUNICATE" else activity)

        if response.op != OpType.ALLREDUCE:
            phase("COMMUNICATE")
        self._execute_unit_on(unit, comm, phase)

    def _execute_unit_on(
        self,
        unit: list[tuple[Response, Request | None]],
        comm: Communicator,
        phase: Callable[[str], None] | None,
    ) -> None:
        """Runs one unit; raises what the collective raised (the caller decides whether
        that fails one request or the job)."""
        response = unit[0][0]
        requests = [request for _, request in unit if request is not None]
        if response.error is not None:
            for request in requests:
                self._finish(request, error=MismatchError(response.error))
            return
        op = response.op
        if op == OpType.ALLREDUCE:
            execute.allreduce(comm, unit, self._buffers, phase)
            self._complete_all(requests)
            return
        if op == OpType.BARRIER:
            comm.barrier()
        elif op == OpType.ADD_PROCESS_SET:
            ident = self.register_process_set(response.payload)
            for request in requests:
                self._finish(request, None, extra=ident)
            return
        elif op == OpType.REMOVE_PROCESS_SET:
            self._remove_process_set(response.payload[0])
        elif op == OpType.JOIN:
            for request in requests:
                self._finish(request, None, extra=response.last_joined)
            return
        if not requests:
            return
        request = requests[0]
        if op == OpType.ALLGATHER:
            self._finish(request, execute.allgather(comm, response, request),
                         extra=response.first_dims)
        elif op == OpType.BROADCAST:
            self._finish(request, execute.broadcast(comm, response, request))
        elif op == OpType.ALLTOALL:
            outputs, received = execute.alltoall(comm, response, request)
            self._finish(request, outputs, extra=received)
        elif op == OpType.REDUCESCATTER:
            self._finish(request, execute.reducescatter(comm, response, request))
        else:
            self._finish(request, None)

    def _complete_all(self, requests: list[Request]) -> None:
        """:meth:`_finish` for the requests of a unit that succeeded, with their outputs: one
        lock and one timeline check for all of them."""
        with self._lock:
            discard = self._inflight.discard
            for request in requests:
                discard(request.ident)
        timeline = self.timeline
        if timeline is not None and timeline.active:
            for request in requests:
                meta = request.meta
                timeline.done(meta.name, {"dtype": meta.dtype, "shape": str(list(meta.shapes))})
        # Last first: a thread waiting for the first handle of a batch (synchronize in
        # submission order) wakes once, when the whole batch is done.
        for request in reversed(requests):
            request.handle.complete(request.outputs)

    def _finish(
        self,
        request: Request,
        result: list[torch.Tensor] | None = None,
        extra: object = None,
        error: BaseException | None = None,
    ) -> None:
        with self._lock:
            self._inflight.discard(request.ident)
        timeline = self.timeline
        if timeline is not None and timeline.active:
            # Before the handle is released: the user may stop the timeline right after.
            meta = request.meta
            timeline.done(meta.name, {"dtype": meta.dtype, "shape": str(list(meta.shapes))})
        if error is not None:
            request.handle.fail(error)
        else:
            request.handle.complete(result, extra)

    def _fail_everything(self, error: BaseException) -> None:
        with self._lock:
            pending = [*self._queue, *self._to_send, *self._sent.values(),
                       *self._waiting_on_cache.values(), *self._executing]
            self._queue, self._to_send = [], []
            self._sent.clear()
            self._waiting_on_cache.clear()
            self._inflight.clear()
        for request in pending:
            if not request.handle.done():
                request.handle.fail(error)


def _not_member_message(label: str, state: ProcessSetState | None, rank: int) -> str:
    title = label.split("_")[-1].capitalize() if label.startswith("grouped") else (
        label.capitalize()
    )
    if state is None:
        return f"{title}: Process set provided does not exist, or has not been registered."
    return f"{title}: Rank {rank} is not a member of the provided process set."


def _named(exc: Exception, name: str) -> HorovodInternalError:
    """The error a request of a failed collective raises: named failures (an NCCL error or
    timeout) keep their class for ``except``."""
    if isinstance(exc, HorovodInternalError):
        return exc
    return HorovodInternalError(f"{name} failed: {exc}")


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


_ALLREDUCE = OpType.ALLREDUCE
_ADASUM = ReduceOp.ADASUM

_CACHEABLE = frozenset(
    {OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST, OpType.ALLTOALL, OpType.REDUCESCATTER}
)


_DTYPE_NAMES = {dtype: name for name, dtype in execute.DTYPES.items()}

_ITEMSIZES = {
    name: torch.empty((), dtype=dtype).element_size() for name, dtype in execute.DTYPES.items()
}
