"""Execution dispatch: runs agreed units on their communicators and completes handles.

A unit is one fused group of allreduces or one other collective (see
:mod:`~baguahvd.engine.fusion`). It runs on the data communicator of its process set, or on
the set's device communicator for GPU tensors (made at the set's first device collective by
the factory the engine was given: every member runs the agreed units in the same order, so
all of them make it in the same one). The tensor arithmetic lives in
:mod:`~baguahvd.engine.execute`; process-set changes are handed back to the engine.

Device units run inside their communicator's ``ordered`` scope (see
:meth:`baguahvd.backends.nccl.NCCLCommunicator.ordered`): after the submitters' streams, on
the communicator's stream. They are launched, not waited for: their handles complete in
:mod:`~baguahvd.engine.completion` once the unit's completion event has fired, while the
engine goes on with the next units. A member that joined contributes zeros on the device its
submissions used.

The engine thread and user threads (single-member sets run on the submitting thread) use
the dispatcher at the same time, so what one call works with is passed down with it (its
fusion buffers, the completions it defers, the outputs it made) instead of being kept on the
dispatcher; each user thread has fusion buffers of its own, and each device communicator
too (units of different communicators run on unordered streams).

A collective that raises here raises to the caller: on the engine thread that fails the
job (see :class:`CollectiveFailure`); for a single-member set, which never leaves the
calling thread, it fails that request only.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from baguahvd.backends import cuda_support, nccl
from baguahvd.backends.base import Communicator, DeviceCommFactory, SelfCommunicator
from baguahvd.common.exceptions import HorovodInternalError, MismatchError
from baguahvd.engine import execute
from baguahvd.engine.completion import CollectiveFailure, Completions, keep_named
from baguahvd.engine.execute import ByteCount, FusionBuffers, FusionPool
from baguahvd.engine.intake import RequestQueue
from baguahvd.engine.messages import OpType, build_response
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Entry, Request
from baguahvd.engine.timeline import Timeline, transport_activity

logger = logging.getLogger("baguahvd.engine")

__all__ = ["CollectiveFailure", "Dispatcher", "named_error"]


def named_error(exc: Exception, name: str) -> HorovodInternalError:
    """The error a request of a failed collective raises (see :func:`keep_named`)."""
    return keep_named(exc, HorovodInternalError(f"{name} failed: {exc}"))


class _Run:
    """What one call that runs a unit works with, passed down instead of kept on the
    dispatcher (whose engine thread and user threads run units at the same time): the unit's
    fusion buffers and, for a device unit launched without waiting, the calls that complete
    its handles once it has finished (``complete``), the tensors it made on the
    communicator's stream for the submitters (``produced``) and what writes its outputs once
    its communication has finished without error (``rest``, see
    :func:`~baguahvd.engine.execute.allreduce`). ``complete`` is None where handles complete
    as soon as the unit has run."""

    __slots__ = ("buffers", "complete", "produced", "rest")

    def __init__(
        self,
        buffers: FusionBuffers,
        complete: list[Callable[[], None]] | None = None,
        produced: list[torch.Tensor] | None = None,
    ) -> None:
        self.buffers = buffers
        self.complete = complete
        self.produced = produced
        self.rest: Callable[[], None] | None = None


class Dispatcher:
    """Runs units and completes their requests (see module docstring).

    Args:
        rank: this process's rank.
        process_sets: the registered process sets, by id.
        queue: the request queue (names of finished requests are freed there).
        timeline: rank 0's timeline, if any.
        device_comms: makes device communicators; None where there are none.
        add_process_set: registers a set of ranks (collective), returns its id.
        remove_process_set: removes the set of an id (collective).
        device_timeout_s: how long one collective of a device communicator may take.
        stopped: the engine's stop error, if any; a device collective being waited for is
            abandoned once there is one.
        single_rank_nccl: single-member sets send CUDA tensors through a one-rank NCCL
            communicator instead of copying them (BAGUAHVD_NCCL_SINGLE_RANK).
        nccl_average: Average uses ``ncclAvg`` where NCCL has it (BAGUAHVD_NCCL_AVERAGE).
    """

    def __init__(
        self,
        rank: int,
        process_sets: dict[int, ProcessSetState],
        queue: RequestQueue,
        timeline: Timeline | None,
        device_comms: DeviceCommFactory | None,
        add_process_set: Callable[[Sequence[int]], int],
        remove_process_set: Callable[[int], None],
        device_timeout_s: float = nccl.DEFAULT_TIMEOUT_S,
        stopped: Callable[[], BaseException | None] | None = None,
        single_rank_nccl: bool = False,
        nccl_average: bool = False,
    ) -> None:
        self.rank = rank
        self.single_rank_nccl = single_rank_nccl
        self.nccl_average = nccl_average
        self.process_sets = process_sets
        self.queue = queue
        self.timeline = timeline
        self.device_comms = device_comms
        self.add_process_set = add_process_set
        self.remove_process_set = remove_process_set
        self.device_timeout_s = device_timeout_s
        self.stopped = stopped
        self.buffers = FusionBuffers()
        """The fusion buffers of the data communicators' units (engine thread only); each
        device communicator has its own (:attr:`ProcessSetState.device_buffers`) and each
        user thread that runs single-member sets' collectives too (:meth:`run_alone`)."""
        self.user_device: torch.device | None = None
        """The CUDA device of this rank's submissions (where its joined zeros go)."""
        self.pending = Completions()
        """Device units launched and not completed yet."""
        self.fusion_bytes = ByteCount()
        """Bytes copied into and out of fusion buffers, by every thread that runs units."""
        self._alone = threading.local()
        """Per user thread: the :class:`_Run` of the single-member collectives it runs."""
        self.capture_relaxed = False
        """Whether the engine thread is in CUDA's relaxed stream-capture mode
        (:func:`~baguahvd.backends.cuda_support.relax_capture_mode`), in which its CUDA
        calls (the polls of launched units' events) leave the users' graph captures alone.
        It switches before its first device unit, its first CUDA call (the process may not
        have initialized CUDA when the engine thread started)."""

    def mark(self, request: Request) -> None:
        """Notes where a submission stands in its submitter's CUDA stream (user thread)."""
        meta = request.meta
        if meta.device == "CPU" and meta.op != OpType.JOIN:
            return
        mark = cuda_support.mark_submission(request.inputs)
        request.mark = mark
        if mark is not None:
            self.user_device = mark.device
        elif request.meta.op == OpType.JOIN and self.user_device is None:
            self.user_device = cuda_support.thread_cuda_device()

    def run_unit(self, unit: list[Entry]) -> None:
        """Runs one agreed unit on this rank (engine thread); raises what it raised."""
        response = unit[0][0]
        state = self.process_sets.get(response.process_set_id)
        if state is None or state.comm is None:
            return
        if response.device != "CPU" and response.error is None:
            if not self.capture_relaxed:
                self.capture_relaxed = cuda_support.relax_capture_mode()
            self.execute_ordered(
                unit, self.device_comm(state, state.comm), state.device_buffers
            )
            return
        self.execute(unit, state.comm)

    def execute_ordered(
        self, unit: list[Entry], comm: Communicator, pool: FusionPool,
        wait_here: bool = False,
    ) -> None:
        """:meth:`execute` in the stream order of a device communicator (module docstring),
        with fusion buffers from the communicator's ``pool``; the handles complete in
        :attr:`pending` once the unit's results are in place, or, with ``wait_here`` (a
        caller that is not the engine thread), before this returns.

        An allreduce is launched in two parts: the copy in, the scaling before and the
        NCCL call now; the scaling after and the copy out into the users' outputs once the
        host has seen the first part finish without error (see
        :mod:`~baguahvd.engine.completion`), so that a failed collective writes nothing into
        the tensors of handles that fail. Its fusion buffers stay its own until then."""
        ordered = getattr(comm, "ordered", None)
        buffers = pool.take()
        if ordered is None:
            self._execute_host_staged(unit, comm, _Run(buffers))
            pool.give_back(buffers)
            return
        marks = [request.mark for _, request in unit
                 if request is not None and request.mark is not None]
        device = marks[0].device if marks else (
            getattr(comm, "device", None) or self.user_device or cuda_support.thread_cuda_device()
        )
        name = unit[0][0].name
        deferred: list[Callable[[], None]] = []
        with ordered(device, marks, name) as launched:
            run = _Run(buffers, deferred, launched.produced)
            self.execute(unit, comm, run)
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
            self.pending.add(comm, launched, unit, deferred, then)
            return
        alone = Completions()
        alone.add(comm, launched, unit, deferred, then)
        alone.drain()

    def run_alone(self, request: Request, state: ProcessSetState) -> None:
        """A single-member process set: no negotiation, no communication."""
        response = build_response([request.meta], state.ranks, ())
        if request.meta.op == OpType.JOIN:
            response = response._replace(last_joined=self.rank)
        comm = state.comm if state.comm is not None else SelfCommunicator()
        if self.timeline is not None and self.timeline.active:
            self.timeline.queued(response.name, response.op, request.activity)
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
                self.execute([(response, request)], comm, self._thread_run())
                if request.inputs and cuda_support.is_cuda(request.inputs[0]):
                    # The identity path queued its copies on the submitter's stream: the
                    # handle's wait returns once they are done, whatever stream reads next.
                    request.handle.device_done = cuda_support.current_stream_done(
                        cuda_support.tensor_device(request.inputs[0])
                    )
        except Exception as exc:  # noqa: BLE001 - reported through the handle
            logger.exception("%s failed", response.name)
            cause = exc.error if isinstance(exc, CollectiveFailure) else exc
            self.finish(request, error=named_error(cause, response.name))

    def _execute_host_staged(self, unit: list[Entry], comm: Communicator, run: _Run) -> None:
        """A device unit on a communicator without stream order of its own (gloo carrying
        CUDA tensors through host memory, HOROVOD_GPU_OPERATIONS=GLOO): it starts once the
        submitters' producers have finished, and its handles complete once its own device
        copies have, so that any stream may read the results."""
        for _, request in unit:
            if request is not None and request.mark is not None:
                request.mark.ready.synchronize()
        complete: list[Callable[[], None]] = []
        run.complete, run.produced = complete, []
        self.execute(unit, comm, run)
        if run.rest is not None:
            run.rest()
        device = next(
            (request.mark.device for _, request in unit
             if request is not None and request.mark is not None), None,
        )
        if device is not None:
            cuda_support.current_stream_done(device).synchronize()
        for call in complete:
            call()

    def _thread_run(self) -> _Run:
        """The calling user thread's :class:`_Run` for single-member collectives that run
        at once: fusion buffers of its own, which no other thread uses. (Those that go
        through a one-rank NCCL communicator take buffers from its pool, as the engine's
        device units do.)"""
        run: _Run | None = getattr(self._alone, "run", None)
        if run is None:
            run = self._alone.run = _Run(FusionBuffers())
        return run

    def _through_nccl(self, request: Request, state: ProcessSetState) -> bool:
        """Whether a single-member collective of CUDA tensors takes a one-rank NCCL
        communicator (made at the first one) instead of the identity fast path."""
        request.mark = cuda_support.mark_submission(request.inputs)
        if request.mark is None:
            return False
        if state.device_comm is None:
            device_comm = nccl.single_rank_communicator(self.device_timeout_s)
            device_comm.stopped = self.stopped
            device_comm.native_average = self.nccl_average
            state.device_comm = device_comm
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
            state.device_comm = self.device_comms(comm)
            if isinstance(state.device_comm, nccl.NCCLCommunicator):
                state.device_comm.timeout_s = self.device_timeout_s
                state.device_comm.stopped = self.stopped
                state.device_comm.native_average = self.nccl_average
        return state.device_comm

    def execute(self, unit: list[Entry], comm: Communicator, run: _Run | None = None) -> None:
        """Runs one unit (a fused group of allreduces, or one other collective) and
        completes its handles. ``run``: the call's buffers and deferred completions (see
        :class:`_Run`); None on the engine thread for a data communicator's unit, which
        uses :attr:`buffers` and completes its handles at once."""
        # The collectives write users' tensors as raw buffers, leaves that require grad
        # included, and their outputs must not join anyone's autograd graph: without grad
        # (the engine thread turns it off for good; a user's thread, for single-member
        # sets, has it on). Tensors made under torch.inference_mode() (an evaluation loop's
        # metrics) can only be written in inference mode, and outputs made for them are
        # inference tensors as well.
        inference = any(
            tensor.is_inference()
            for _, request in unit if request is not None
            for tensor in (*request.inputs, *(request.outputs or ()))
        )
        if inference or torch.is_grad_enabled():
            with torch.inference_mode() if inference else torch.no_grad():
                self._execute_traced(unit, comm, run)
            if run is not None and run.rest is not None:
                # Run later, maybe by another thread: under the same mode.
                run.rest = functools.partial(_without_grad, run.rest, inference)
        else:
            self._execute_traced(unit, comm, run)

    def _execute_traced(self, unit: list[Entry], comm: Communicator, run: _Run | None) -> None:
        timeline = self.timeline
        if timeline is None or not timeline.active:
            self._execute_on(unit, comm, None, run)
            return
        response = unit[0][0]
        traced = [request.meta.name for _, request in unit if request is not None]
        transport = transport_activity(response.op, response.device)

        def phase(activity: str) -> None:
            for name in traced:
                timeline.phase(name, transport if activity == "COMMUNICATE" else activity)

        if response.op != OpType.ALLREDUCE:
            phase("COMMUNICATE")
        self._execute_on(unit, comm, phase, run)

    def _execute_on(
        self, unit: list[Entry], comm: Communicator, phase: Callable[[str], None] | None,
        run: _Run | None,
    ) -> None:
        response = unit[0][0]
        requests = [request for _, request in unit if request is not None]
        if response.error is not None:
            for request in requests:
                self.finish(request, error=MismatchError(response.error))
            return
        op = response.op
        if op == OpType.ALLREDUCE:
            copied = self.fusion_bytes
            if run is None:
                execute.allreduce(
                    comm, unit, self.buffers, phase, self.user_device, copied=copied
                )
            elif run.complete is None:
                execute.allreduce(
                    comm, unit, run.buffers, phase, self.user_device, copied=copied
                )
            else:
                run.rest = execute.allreduce(
                    comm, unit, run.buffers, phase, self.user_device, split=True,
                    copied=copied,
                )
            self.complete_all(requests, run)
            return
        if op == OpType.BARRIER:
            comm.barrier()
        elif op == OpType.ADD_PROCESS_SET:
            ident = self.add_process_set(response.payload)
            for request in requests:
                self.finish(request, None, extra=ident, run=run)
            return
        elif op == OpType.REMOVE_PROCESS_SET:
            self.remove_process_set(response.payload[0])
        elif op == OpType.JOIN:
            for request in requests:
                self.finish(request, None, extra=response.last_joined, run=run)
            return
        if not requests:
            return
        request = requests[0]
        if op == OpType.ALLGATHER:
            self.finish(request, execute.allgather(comm, response, request),
                        extra=response.first_dims, run=run)
        elif op == OpType.BROADCAST:
            self.finish(request, execute.broadcast(comm, response, request), run=run)
        elif op == OpType.ALLTOALL:
            outputs, received = execute.alltoall(comm, response, request)
            self.finish(request, outputs, extra=received, run=run)
        elif op == OpType.REDUCESCATTER:
            self.finish(request, execute.reducescatter(comm, response, request), run=run)
        else:
            self.finish(request, None, run=run)

    def complete_all(self, requests: list[Request], run: _Run | None = None) -> None:
        """:meth:`finish` for the requests of a unit that succeeded, with their outputs: one
        lock and one timeline check for all of them (deferred as ``run`` says)."""
        if run is not None and run.complete is not None:
            run.complete.append(lambda: self.complete_all(requests))
            return
        self.queue.done(requests)
        timeline = self.timeline
        if timeline is not None and timeline.active:
            for request in requests:
                meta = request.meta
                timeline.done(meta.name, {"dtype": meta.dtype, "shape": str(list(meta.shapes))})
        # Last first: a thread waiting for the first handle of a batch (synchronize in
        # submission order) wakes once, when the whole batch is done.
        for request in reversed(requests):
            request.handle.complete(request.outputs)

    def finish(
        self,
        request: Request,
        result: list[torch.Tensor] | None = None,
        extra: object = None,
        error: BaseException | None = None,
        run: _Run | None = None,
    ) -> None:
        """Completes or fails one request; a completion is deferred as ``run`` says, and its
        results are then tensors made on the communicator's stream."""
        if run is not None and run.complete is not None and error is None:
            if run.produced is not None:
                run.produced.extend(result or ())
            run.complete.append(lambda: self.finish(request, result, extra))
            return
        self.queue.done((request,))
        timeline = self.timeline
        if timeline is not None and timeline.active:
            # Before the handle is released: the user may stop the timeline right after.
            meta = request.meta
            timeline.done(meta.name, {"dtype": meta.dtype, "shape": str(list(meta.shapes))})
        if error is not None:
            request.handle.fail(error)
        else:
            request.handle.complete(result, extra)


def _without_grad(call: Callable[[], None], inference: bool) -> None:
    """``call()`` without autograd, in inference mode where the unit's tensors need it
    (see :meth:`Dispatcher.execute`)."""
    with torch.inference_mode() if inference else torch.no_grad():
        call()
