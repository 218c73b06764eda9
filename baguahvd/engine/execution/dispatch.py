"""Execution dispatch: runs agreed units on their communicators and completes handles.

A unit is one fused group of allreduces or one other collective (see
:mod:`~baguahvd.engine.execution.fusion`). It runs on the data communicator of its process
set, or on the set's device communicator for GPU tensors (made at the set's first device
collective by the factory the engine was given: every member runs the agreed units in the
same order, so all of them make it in the same one). The tensor arithmetic lives in
:mod:`~baguahvd.engine.execution.execute`; process-set changes go to the registry the
dispatcher was given. Every request's outcome (:class:`~baguahvd.engine.requests.Outcome`)
is delivered to its handle here, or, for a unit launched without waiting, by
:mod:`~baguahvd.engine.execution.completion`.

Device units run inside their communicator's ``ordered`` scope (see
:meth:`baguahvd.backends.nccl.NCCLCommunicator.ordered`): after the submitters' streams, on
the communicator's stream. They are launched, not waited for: their handles complete in
:mod:`~baguahvd.engine.execution.completion` once the unit's completion event has fired, while the
engine goes on with the next units. A member that joined contributes zeros on the device its
submissions used. Allreduces of CPU tensors on a transport whose own threads carry them
(:attr:`~baguahvd.backends.base.Communicator.launches_allreduce`: gloo's) are started too,
not waited for: every rank starts the next units in the agreed order while they run, back
to back on the wire; their scaling after, copy out and handles wait for their completion.

The engine thread and user threads (single-member sets run on the submitting thread) use
the dispatcher at the same time, so what one call works with is passed down with it (its
fusion buffers, whether it is launched without waiting) and what it made comes back as its
return value, instead of being kept on the dispatcher; each user thread has fusion buffers
of its own, and each device communicator too (units of different communicators run on
unordered streams).

A collective that raises here raises to the caller: on the engine thread that fails the
job (see :class:`CollectiveFailure`); for a single-member set, which never leaves the
calling thread, it fails that request only.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

import torch

from baguahvd.backends import cuda_support, nccl
from baguahvd.backends.base import Communicator, DeviceCommFactory, SelfCommunicator, Started
from baguahvd.common.exceptions import HorovodInternalError, MismatchError
from baguahvd.engine.buffers import ByteCount, FusionBuffers, FusionPool
from baguahvd.engine.execution import execute
from baguahvd.engine.execution.completion import (
    CollectiveFailure,
    Completions,
    HostLaunched,
    Outcome,
    deliver,
    keep_named,
    succeeded,
)
from baguahvd.engine.messages import OpType, build_response
from baguahvd.engine.process_sets import ProcessSetRegistry, ProcessSetState
from baguahvd.engine.requests import Entry, Request
from baguahvd.engine.submission import Submissions
from baguahvd.engine.timeline import Timeline, transport_activity

logger = logging.getLogger("baguahvd.engine")

class _Run:
    """What one call that runs a unit works with, passed down instead of kept on the
    dispatcher (whose engine thread and user threads run units at the same time): the unit's
    fusion buffers, whether it is launched without waiting (``split``: then what writes its
    outputs once its communication has finished without error is left in ``rest``, see
    :func:`~baguahvd.engine.execution.execute.allreduce`; a host unit's allreduces started
    are listed in ``started``)."""

    __slots__ = ("buffers", "split", "rest", "started")

    def __init__(self, buffers: FusionBuffers, split: bool = False,
                 started: list[Started] | None = None) -> None:
        self.buffers = buffers
        self.split = split
        self.rest: Callable[[], None] | None = None
        self.started = started


class Dispatcher:
    """Runs units and completes their requests (see module docstring).

    Args:
        rank: this process's rank.
        process_sets: the registered process sets, by id.
        timeline: rank 0's timeline, if any.
        device_comms: makes device communicators; None where there are none.
        registry: adds and removes process sets for the units that change them (the
            engine's registry, whose ``states`` are ``process_sets``); without one, such
            units fail.
        device_timeout_s: how long one collective of a device communicator may take.
        stopped: the engine's stop error, if any; a device collective being waited for is
            abandoned once there is one.
        single_rank_nccl: single-member sets send CUDA tensors through a one-rank NCCL
            communicator instead of copying them (BAGUAHVD_NCCL_SINGLE_RANK).
        nccl_average: Average uses ``ncclAvg`` where NCCL has it (BAGUAHVD_NCCL_AVERAGE).
        submissions: the engine's record of its submissions, whose ``user_device`` (noted
            by the submitting threads) says where a joined member's zeros go.
    """

    def __init__(
        self,
        rank: int,
        process_sets: dict[int, ProcessSetState],
        timeline: Timeline | None = None,
        device_comms: DeviceCommFactory | None = None,
        *,
        registry: ProcessSetRegistry | None = None,
        device_timeout_s: float = nccl.DEFAULT_TIMEOUT_S,
        stopped: Callable[[], BaseException | None] | None = None,
        single_rank_nccl: bool = False,
        nccl_average: bool = False,
        submissions: Submissions | None = None,
    ) -> None:
        self.rank, self.process_sets, self.registry = rank, process_sets, registry
        self.timeline, self.device_comms = timeline, device_comms
        self.single_rank_nccl = single_rank_nccl
        self.device_timeout_s = device_timeout_s
        # What every NCCL communicator made here is given (see _configured).
        self._nccl_settings = (device_timeout_s, stopped, nccl_average)
        self.buffers = FusionBuffers()
        """The fusion buffers of the data communicators' units (engine thread only); each
        device communicator has its own (:attr:`ProcessSetState.device_buffers`) and each
        user thread that runs single-member sets' collectives too (:meth:`run_alone`)."""
        self.submissions = submissions if submissions is not None else Submissions()
        """Where this rank's user threads submit from (read only here: where the zeros of a
        member that joined go)."""
        self.pending = Completions(timeline)
        """Units launched and not completed yet."""
        self.fusion_bytes = ByteCount()
        """Bytes copied into and out of fusion buffers, by every thread that runs units."""
        self._alone = threading.local()
        """Per user thread: the fusion buffers of the single-member collectives it runs."""
        self.capture_relaxed = False
        """Whether the engine thread is in CUDA's relaxed stream-capture mode
        (:func:`~baguahvd.backends.cuda_support.relax_capture_mode`), in which its polls of
        launched units' events leave the users' graph captures alone; it switches before its
        first device unit, its first CUDA call (CUDA may not be initialized before)."""

    def run_unit(self, unit: list[Entry]) -> None:
        """Runs one agreed unit on this rank (engine thread); raises what it raised. Its
        handles complete once it has run, in the agreed order (see :attr:`pending`)."""
        response = unit[0][0]
        state = self.process_sets.get(response.meta.process_set_id)
        if state is None or state.comm is None:
            return
        if response.meta.device != "CPU" and response.error is None:
            if not self.capture_relaxed:
                self.capture_relaxed = cuda_support.relax_capture_mode()
            self.execute_ordered(
                unit, self.device_comm(state, state.comm), state.device_buffers
            )
            return
        if response.meta.op == OpType.ALLREDUCE and state.comm.launches_allreduce:
            self.launch_host(unit, state.comm)
            return
        self.pending.complete(unit, self.execute(unit, state.comm, _Run(self.buffers)))

    def launch_host(self, unit: list[Entry], comm: Communicator) -> None:
        """Starts an allreduce unit on ``comm``'s own threads (module docstring); the rest
        of it runs, and its handles complete, in :attr:`pending`."""
        host, started = self.pending.host, list[Started]()
        run = _Run(host.buffers.take(), split=True, started=started)
        outcomes = self.execute(unit, comm, run)
        then = host.then(run.rest, run.buffers)
        self.pending.add(host, HostLaunched(tuple(started)), unit, outcomes, then)

    def execute_ordered(
        self, unit: list[Entry], comm: Communicator, pool: FusionPool,
        wait_here: bool = False,
    ) -> None:
        """:meth:`execute` in the stream order of a device communicator (module docstring),
        with fusion buffers from the communicator's ``pool``; the handles complete in
        :attr:`pending` once the unit's results are in place, or, with ``wait_here`` (a
        caller that is not the engine thread), before this returns.

        An allreduce is launched in two parts: the copy in, the scaling before and the NCCL
        call now; the scaling after and the copy out into the users' outputs once the host
        has seen the first part finish without error (see
        :mod:`~baguahvd.engine.execution.completion`), so that a failed collective writes
        nothing into the tensors of handles that fail. Its fusion buffers stay its own until
        then."""
        ordered = getattr(comm, "ordered", None)
        buffers = pool.take()
        if ordered is None:
            deliver(self._execute_host_staged(unit, comm, _Run(buffers, split=True)),
                    self.timeline)
            pool.give_back(buffers)
            return
        marks = [request.mark for _, request in unit
                 if request is not None and request.mark is not None]
        device = marks[0].device if marks else (
            getattr(comm, "device", None) or self.submissions.user_device
            or cuda_support.thread_cuda_device()
        )
        # The request's name: an unnamed cache hit runs under an earlier call's response.
        response, own = unit[0]
        name = (response if own is None else own).meta.name
        with ordered(device, marks, name) as launched:
            run = _Run(buffers, split=True)
            outcomes = self.execute(unit, comm, run)
            if unit[0][0].meta.op != OpType.ALLREDUCE:  # made for the submitters (see ordered)
                launched.produced.extend(t for outcome in outcomes for t in outcome.result or ())
        rest = run.rest
        then: Callable[[], object] | None = None
        if rest is None:
            pool.give_back(buffers)
        else:
            def then() -> object:
                with ordered(device, (), name) as launched_rest:
                    rest()
                # Its last use is queued on the communicator's stream.
                pool.give_back(buffers)
                return launched_rest

        if not wait_here:
            self.pending.add(comm, launched, unit, outcomes, then)
            return
        alone = Completions(self.timeline)
        alone.add(comm, launched, unit, outcomes, then)
        alone.drain()

    def run_alone(self, request: Request, state: ProcessSetState) -> None:
        """A single-member process set: no negotiation, no communication."""
        response = build_response([request.meta], state.ranks, ())
        if request.meta.op == OpType.JOIN:
            response = response._replace(last_joined=self.rank)
        comm = state.comm if state.comm is not None else SelfCommunicator()
        if self.timeline is not None and self.timeline.active:
            self.timeline.queued(response.meta.name, response.meta.op, request.activity)
        try:
            if self.single_rank_nccl and self._through_nccl(request, state):
                assert state.device_comm is not None
                # The submitting thread runs it: only the engine thread polls launched
                # units, so this one is waited for here.
                self.execute_ordered(
                    [(response, request)], state.device_comm, state.device_buffers,
                    wait_here=True,
                )
            else:
                outcomes = self.execute([(response, request)], comm, self._thread_run())
                if request.inputs and cuda_support.is_cuda(request.inputs[0]):
                    # The identity path queued its copies on the submitter's stream: the
                    # handle's wait returns once they are done, whatever stream reads next.
                    request.handle.device_done = cuda_support.current_stream_done(
                        cuda_support.tensor_device(request.inputs[0])
                    )
                deliver(outcomes, self.timeline)
        except Exception as exc:  # noqa: BLE001 - reported through the handle
            logger.exception("%s failed", response.meta.name)
            cause = exc.error if isinstance(exc, CollectiveFailure) else exc
            error = HorovodInternalError(f"{response.meta.name} failed: {cause}")
            deliver([Outcome(request, error=keep_named(cause, error))], self.timeline)

    def _execute_host_staged(
        self, unit: list[Entry], comm: Communicator, run: _Run
    ) -> list[Outcome]:
        """A device unit on a communicator without stream order of its own (gloo carrying
        CUDA tensors through host memory, HOROVOD_GPU_OPERATIONS=GLOO): it starts once the
        submitters' producers have finished, and its handles complete once its own device
        copies have, so that any stream may read the results."""
        for _, request in unit:
            if request is not None and request.mark is not None:
                request.mark.ready.synchronize()
        outcomes = self.execute(unit, comm, run)
        if run.rest is not None:
            run.rest()
        device = next(
            (request.mark.device for _, request in unit
             if request is not None and request.mark is not None), None,
        )
        if device is not None:
            cuda_support.current_stream_done(device).synchronize()
        return outcomes

    def _thread_run(self) -> _Run:
        """A :class:`_Run` for a single-member collective that runs at once in the calling
        user thread, with fusion buffers of that thread's own (those that go through a
        one-rank NCCL communicator take buffers from its pool, as device units do)."""
        buffers: FusionBuffers | None = getattr(self._alone, "buffers", None)
        if buffers is None:
            buffers = self._alone.buffers = FusionBuffers()
        return _Run(buffers)

    def _through_nccl(self, request: Request, state: ProcessSetState) -> bool:
        """Whether a single-member collective of CUDA tensors takes a one-rank NCCL
        communicator (made at the first one) instead of the identity fast path."""
        request.mark = cuda_support.mark_submission(request.inputs)
        if request.mark is None:
            return False
        if state.device_comm is None:
            state.device_comm = self._configured(
                nccl.single_rank_communicator(self.device_timeout_s)
            )
        return True

    def device_comm(self, state: ProcessSetState, comm: Communicator) -> Communicator:
        """The set's device communicator, created on first use (see module docstring)."""
        if isinstance(comm, SelfCommunicator):
            return comm
        if state.device_comm is None:
            if self.device_comms is None:
                raise HorovodInternalError(
                    "this engine was built without device communicators; GPU tensors "
                    "cannot be reduced"
                )
            state.device_comm = self._configured(self.device_comms(comm))
        return state.device_comm

    def _configured(self, comm: Communicator) -> Communicator:
        """``comm`` with this rank's NCCL settings, when it is an NCCL communicator: the
        timeout of one collective, the engine's stop error (a collective being waited for is
        abandoned once there is one) and whether Average uses ``ncclAvg``."""
        if isinstance(comm, nccl.NCCLCommunicator):
            comm.timeout_s, comm.stopped, comm.native_average = self._nccl_settings
        return comm

    def execute(self, unit: list[Entry], comm: Communicator, run: _Run) -> list[Outcome]:
        """Runs one unit (a fused group of allreduces, or one other collective) with the
        call's buffers (see :class:`_Run`); returns how its requests ended."""
        # The collectives write users' tensors as raw buffers, leaves that require grad
        # included, and their outputs must not join anyone's autograd graph: without grad
        # (the engine thread turns it off for good; a user's thread, for single-member
        # sets, has it on). Tensors made under torch.inference_mode() (an evaluation loop's
        # metrics) can only be written in inference mode, and outputs made for them are
        # inference tensors as well.
        inference = execute.any_inference(unit)
        if inference or torch.is_grad_enabled():
            with torch.inference_mode() if inference else torch.no_grad():
                outcomes = self._execute_traced(unit, comm, run)
            if run.rest is not None:
                # Run later, maybe by another thread: under the same mode.
                run.rest = functools.partial(execute.without_grad, run.rest, inference)
            return outcomes
        return self._execute_traced(unit, comm, run)

    def _execute_traced(self, unit: list[Entry], comm: Communicator, run: _Run) -> list[Outcome]:
        timeline = self.timeline
        if timeline is None or not timeline.active:
            return self._execute_on(unit, comm, None, run)
        response = unit[0][0]
        traced = [request.meta.name for _, request in unit if request is not None]
        transport = transport_activity(response.meta.op, response.meta.device)

        def phase(activity: str) -> None:
            for name in traced:
                timeline.phase(name, transport if activity == "COMMUNICATE" else activity)

        if response.meta.op != OpType.ALLREDUCE:
            phase("COMMUNICATE")
        return self._execute_on(unit, comm, phase, run)

    def _execute_on(
        self, unit: list[Entry], comm: Communicator, phase: Callable[[str], None] | None,
        run: _Run,
    ) -> list[Outcome]:
        response = unit[0][0]
        requests = [request for _, request in unit if request is not None]
        if response.error is not None:
            return [Outcome(request, error=MismatchError(response.error))
                    for request in requests]
        op = response.meta.op
        if op == OpType.ALLREDUCE:
            run.rest = execute.allreduce(
                comm, unit, run.buffers, phase, self.submissions.user_device, split=run.split,
                copied=self.fusion_bytes, started=run.started,
            )
            return succeeded(requests)
        if op == OpType.BARRIER:
            comm.barrier()
        elif op == OpType.ADD_PROCESS_SET:
            ident = self._registry().register(response.meta.payload)
            return [Outcome(request, extra=ident) for request in requests]
        elif op == OpType.REMOVE_PROCESS_SET:
            self._registry().remove(response.meta.payload[0])
        elif op == OpType.JOIN:
            return [Outcome(request, extra=response.last_joined) for request in requests]
        if not requests:
            return []
        request = requests[0]
        if op == OpType.ALLGATHER:
            return [Outcome(request, execute.allgather(comm, response, request),
                            response.first_dims)]
        if op == OpType.BROADCAST:
            return [Outcome(request, execute.broadcast(comm, response, request))]
        if op == OpType.ALLTOALL:
            outputs, received = execute.alltoall(comm, response, request)
            return [Outcome(request, outputs, received)]
        if op == OpType.REDUCESCATTER:
            return [Outcome(request, execute.reducescatter(comm, response, request))]
        return [Outcome(request)]

    def _registry(self) -> ProcessSetRegistry:
        if self.registry is None:
            raise HorovodInternalError("this dispatcher cannot change process sets")
        return self.registry
