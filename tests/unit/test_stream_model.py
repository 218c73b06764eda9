"""The GPU path under the stream model (``tests/fakes/stream_model.py``).

The first tests show that the model catches each kind of ordering bug. The others run the
engine's dispatcher and the NCCL backend the way a rank does: the user thread writes its
tensors on its own stream and submits them, an engine thread runs the agreed unit, and the
user reads the results on its stream (or on the host) after waiting on the handle. A missing
event, a wrong device or a result completed too early raises :class:`StreamViolation`.
"""

from __future__ import annotations

import threading

import pytest
import torch

from baguahvd.backends import nccl as backend
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.execution.dispatch import Dispatcher
from baguahvd.engine.messages import OpType, RequestMeta, Response, dtype_name
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Request
from tests.fakes import fake_mpi
from tests.fakes.responses import agreed, redescribed
from tests.fakes.stream_model import (
    HOST,
    ModelEvent,
    StreamModel,
    StreamViolation,
    installed_model,
    on_thread,
)

pytestmark = pytest.mark.stream_model

GPU = 1
"""The process's GPU: not 0, so that anything that falls back to GPU 0 shows."""
CUDA = f"cuda:{GPU}"
SEEDS = [0, 1, 2]


@pytest.fixture(params=SEEDS)
def model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    return installed_model(monkeypatch, GPU, request.param)



# ---------------------------------------------------------------------------------------
# What the model catches


def test_a_read_on_another_stream_needs_an_event(model: StreamModel) -> None:
    producer, consumer = model.stream("producer"), model.stream("consumer")
    with model.active():
        with model.use(producer):
            tensor = torch.ones(4, device=CUDA)
        with model.use(consumer), pytest.raises(StreamViolation, match="no event"):
            tensor.sum()


def test_an_event_orders_the_read(model: StreamModel) -> None:
    producer, consumer = model.stream("producer"), model.stream("consumer")
    event = ModelEvent()
    with model.active():
        with model.use(producer):
            tensor = torch.ones(4, device=CUDA)
        model.record(event, producer)
        model.wait(consumer, event)
        with model.use(consumer):
            assert float(tensor.sum()) == 4.0


def test_a_write_while_another_stream_reads_is_caught(model: StreamModel) -> None:
    reader = model.stream("reader")
    event = ModelEvent()
    with model.active():
        tensor = torch.ones(4, device=CUDA)
        model.record(event, model.default)
        model.wait(reader, event)
        with model.use(reader):
            tensor.sum()
        with pytest.raises(StreamViolation, match="may still be using"):
            tensor.add_(1)


def test_memory_is_settled_for_a_stream_once_an_event_orders_every_use(
    model: StreamModel,
) -> None:
    reader = model.stream("reader")
    with model.active():
        tensor = torch.ones(4, device=CUDA)
        written = ModelEvent()
        model.record(written, model.default)
        model.wait(reader, written)
        with model.use(reader):
            tensor.sum()
        assert not model.settled_for(tensor, model.default)
        read = ModelEvent()
        model.record(read, reader)
        model.wait(model.default, read)
        assert model.settled_for(tensor, model.default)


def test_the_host_must_synchronize_before_reading(model: StreamModel) -> None:
    with model.active():
        tensor = torch.ones(4, device=CUDA)
    with pytest.raises(StreamViolation, match="before synchronizing"):
        model.host_read(tensor)
    model.synchronize_stream(model.default)
    model.host_read(tensor)


def test_reused_memory_needs_record_stream(model: StreamModel) -> None:
    side = model.stream("side")
    event = ModelEvent()
    with model.active():
        tensor = torch.ones(4, device=CUDA)
    model.record(event, model.default)
    model.wait(side, event)
    with model.active(), model.use(side):
        tensor.sum()
    # The default stream's allocator hands the same block out again.
    with pytest.raises(StreamViolation, match="record_stream"):
        model.allocate(tensor, model.default, model._step(model.default), GPU)
    model.record_stream(tensor, side)
    model.allocate(tensor, model.default, model._step(model.default), GPU)


def test_host_and_device_tensors_do_not_mix(model: StreamModel) -> None:
    with model.active():
        device, host = torch.ones(4, device=CUDA), torch.tensor([1.0, 2.0])
        assert model.device_of(host) == HOST
        with pytest.raises(StreamViolation, match="mixes"):
            torch.cat([device, host])


def test_memory_on_another_gpu_is_caught(model: StreamModel) -> None:
    with model.active(), pytest.raises(StreamViolation, match="cuda:0"):
        torch.zeros(2, device="cuda:0")


def test_queued_work_runs_later_and_events_report_it(model: StreamModel) -> None:
    stream = model.stream("work")
    event = ModelEvent()
    with model.active(), model.use(stream):
        for _ in range(5):
            torch.ones(2, device=CUDA)
    model.record(event, stream)
    assert stream.ran == 0
    model.synchronize(event)
    assert stream.ran >= event.position


# ---------------------------------------------------------------------------------------
# One rank of two: its user thread and its engine thread


class Rank:
    """Rank 0 of a two-member process set whose device communicator is NCCL (fake MPI)."""

    def __init__(self) -> None:
        self.nccl = backend.NCCLCommunicator(fake_mpi.members(2)[0])
        state = ProcessSetState(0, (0, 1), comm=object(), device_comm=self.nccl)  # type: ignore[arg-type]
        self.dispatcher = Dispatcher(0, {0: state})

    def submit(self, op: OpType, inputs: list[torch.Tensor],
               outputs: list[torch.Tensor] | None, **fields: object) -> Request:
        meta = RequestMeta(
            key=f"{op.name}.t", name=f"{op.name}.t", op=op, process_set_id=0, rank=0,
            dtype=dtype_name(inputs[0].dtype) if inputs else "",
            shapes=tuple(tuple(t.shape) for t in inputs), device="GPU",
        )
        request = Request(meta, inputs, outputs)
        self.dispatcher.submissions.mark(request)
        return request

    def run(self, model: StreamModel, entries: list[tuple[Response, Request | None]]) -> None:
        """Launches the unit and completes it, as the engine thread does."""

        def engine() -> None:
            self.dispatcher.run_unit(entries)
            self.dispatcher.pending.drain()

        on_thread(model, engine)


def response(op: OpType, shapes: tuple[tuple[int, ...], ...], **fields: object) -> Response:
    return agreed(key=f"{op.name}.t", name=f"{op.name}.t", op=op, process_set_id=0,
                    dtype="float32", shapes=shapes, device="GPU", **fields)  # type: ignore[arg-type]


def user_tensors(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Tensors the user's kernels write on the current stream (a backward pass)."""
    return [torch.ones(shape, device=CUDA).mul_(2) for shape in shapes]


CASES: dict[str, tuple[OpType, list[tuple[int, ...]], dict[str, object]]] = {
    "allreduce": (OpType.ALLREDUCE, [(5,)], {}),
    "allreduce-scaled": (OpType.ALLREDUCE, [(5,)], {"prescale": 0.5, "postscale": 3.0}),
    "fused-average": (OpType.ALLREDUCE, [(3,), (2, 2), (4,)], {"reduce_op": ReduceOp.AVERAGE}),
    "broadcast": (OpType.BROADCAST, [(6,)], {"root": 0}),
    "allgather": (OpType.ALLGATHER, [(2, 3)], {"first_dims": ((2, 1),)}),
    "reducescatter": (OpType.REDUCESCATTER, [(4, 2)], {}),
    "alltoall": (OpType.ALLTOALL, [(3,)], {"splits": ((1, 2), (2, 1))}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_collective_on_the_users_stream_is_ordered_both_ways(
    model: StreamModel, case: str
) -> None:
    op, shapes, fields = CASES[case]
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        inputs = user_tensors(*shapes)
        # Zeros: the fake NCCL calls write no data, and scaling garbage may warn.
        outputs = [torch.zeros_like(t) for t in inputs] if op != OpType.ALLGATHER else None
        if op in (OpType.REDUCESCATTER, OpType.ALLTOALL):
            outputs = None
        request = rank.submit(op, inputs, outputs)
    rank.run(model, [(response(op, tuple(shapes), **fields), request)])
    with model.active(), model.use(user):
        results = request.handle.wait()
        assert results is not None or request.outputs is not None
        for tensor in results or request.outputs or []:
            tensor.sum()  # read on the user's stream
            model.host_read(tensor)  # the handle completed after the stream finished


def test_a_later_kernel_on_the_users_stream_may_overwrite_the_inputs(
    model: StreamModel
) -> None:
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        inputs = user_tensors((3,), (4,))
        request = rank.submit(OpType.ALLREDUCE, inputs, [torch.empty_like(t) for t in inputs])
    rank.run(model, [(response(OpType.ALLREDUCE, ((3,), (4,))), request)])
    with model.active(), model.use(user):
        request.handle.wait()
        assert all(model.settled_for(tensor, user) for tensor in inputs)
        for tensor in inputs:
            tensor.zero_()  # the next backward pass


def test_the_engine_thread_selects_the_process_gpu_once_and_keeps_it(
    model: StreamModel
) -> None:
    rank, user = Rank(), model.stream("user")
    seen: list[int] = []
    with model.active(), model.use(user):
        inputs = user_tensors((4,))
        request = rank.submit(OpType.ALLREDUCE, inputs, [torch.empty_like(inputs[0])])

    def engine() -> None:
        rank.dispatcher.run_unit([(response(OpType.ALLREDUCE, ((4,),)), request)])
        seen.extend([model.cupy_device(), model.torch_device()])

    on_thread(model, engine)
    assert seen == [GPU, GPU]


def test_the_user_thread_keeps_its_cupy_device(model: StreamModel) -> None:
    model._local.cupy_device = 0  # users select torch's device, not CuPy's
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        rank.submit(OpType.ALLREDUCE, user_tensors((4,)), None)
    assert model.cupy_device() == 0


def test_a_member_that_joined_first_puts_its_zeros_on_its_gpu(model: StreamModel) -> None:
    rank = Rank()
    rank.submit(OpType.JOIN, [], None)
    assert rank.dispatcher.submissions.user_device == torch.device("cuda", GPU)
    rank.run(model, [(response(OpType.ALLREDUCE, ((3,), (2,))), None)])
    assert rank.nccl.device == torch.device("cuda", GPU)


@pytest.mark.parametrize("op", [OpType.ALLGATHER, OpType.REDUCESCATTER, OpType.ALLTOALL])
def test_outputs_made_on_the_nccl_stream_are_recorded_for_the_users_stream(
    model: StreamModel, op: OpType
) -> None:
    _, shapes, fields = CASES[op.name.lower()]
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        request = rank.submit(op, user_tensors(*shapes), None)
    rank.run(model, [(response(op, tuple(shapes), **fields), request)])
    with model.active(), model.use(user):
        (output,) = request.handle.wait() or []
        output.sum()
    nccl_stream = model.streams[rank.nccl._stream.ptr]
    assert model.buffer(output).stream == nccl_stream.ident
    assert user.ident in model.buffer(output).recorded
    # The user drops the output; the allocator hands its block to the NCCL stream again.
    model.allocate(output, nccl_stream, model._step(nccl_stream), GPU)


# ---------------------------------------------------------------------------------------
# Launched units complete later, from their events


def allreduce_unit(rank: Rank, name: str, *shapes: tuple[int, ...]) -> tuple[
    Request, list[torch.Tensor], list[tuple[Response, Request | None]]
]:
    """An allreduce of user tensors (fused when several), submitted on the current stream."""
    inputs = user_tensors(*shapes)
    request = rank.submit(OpType.ALLREDUCE, inputs, [torch.empty_like(t) for t in inputs])
    entry = redescribed(response(OpType.ALLREDUCE, tuple(shapes)), key=name, name=name)
    return request, inputs, [(entry, request)]


def test_the_engine_launches_the_next_unit_before_the_first_has_finished(
    model: StreamModel
) -> None:
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        first, _, unit1 = allreduce_unit(rank, "a", (3,), (2,))
        second, _, unit2 = allreduce_unit(rank, "b", (4,), (1,))
    launched: list[bool] = []

    def engine() -> None:
        rank.dispatcher.run_unit(unit1)
        rank.dispatcher.run_unit(unit2)
        (done1, done2) = [p.launched.done.model for p in rank.dispatcher.pending._units]
        # Both collectives are queued on the NCCL stream; neither has run.
        launched.append(done1.stream.ran < done1.position)
        launched.append(not first.handle.done() and not second.handle.done())
        rank.dispatcher.pending.drain()

    on_thread(model, engine)
    assert launched == [True, True]
    assert [call[0] for call in model.fake.log.work("allReduce")] == ["allReduce"] * 2
    assert first.handle.done() and second.handle.done()


def test_a_handle_completes_only_after_its_event_fired(model: StreamModel) -> None:
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        units = [allreduce_unit(rank, f"u{i}", (i + 2,)) for i in range(3)]
    seen: list[tuple[bool, ...]] = []

    def engine() -> None:
        for _, _, unit in units:
            rank.dispatcher.run_unit(unit)
        events = [p.launched.done.model for p in rank.dispatcher.pending._units]
        while len(rank.dispatcher.pending):
            rank.dispatcher.pending.poll()
            for (request, _, _), event in zip(units, events):
                fired = event.stream.ran >= event.position
                seen.append((request.handle.done(), fired))

    on_thread(model, engine)
    assert all(fired for done, fired in seen if done)
    assert any(not done for done, _ in seen)  # the polls saw units still running


def test_the_users_stream_does_not_wait_for_a_launched_unit(model: StreamModel) -> None:
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        request, _, unit = allreduce_unit(rank, "a", (4,))

    events: list[ModelEvent] = []

    def engine() -> None:
        rank.dispatcher.run_unit(unit)
        events.extend(p.launched.done.model for p in rank.dispatcher.pending._units)

    on_thread(model, engine)
    nccl_stream = model.streams[rank.nccl._stream.ptr]
    with model.active(), model.use(user):
        later = torch.ones(8, device=CUDA).mul_(3)  # the rest of the backward pass
    # The host waited for the communicator's warm-up, not for the unit.
    (done,) = events
    assert user.clock.get(nccl_stream.ident, 0) < done.position
    assert all(waits is None or waits.stream is not nccl_stream for _, waits in user.queue)
    assert not request.handle.done()
    # The user's later kernel finishes without the collective running at all.
    event = ModelEvent()
    model.record(event, user)
    while not model.query(event):
        pass
    model.host_read(later)


def test_memory_of_completed_units_may_be_reused_on_the_users_stream(
    model: StreamModel
) -> None:
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        first, inputs1, unit1 = allreduce_unit(rank, "a", (3,))
        second, inputs2, unit2 = allreduce_unit(rank, "b", (5,))

    reused = threading.Event()

    def engine() -> None:
        rank.dispatcher.run_unit(unit1)
        rank.dispatcher.run_unit(unit2)
        while not first.handle.done():
            rank.dispatcher.pending.poll()
        assert reused.wait(30)
        rank.dispatcher.pending.drain()

    def user_thread() -> None:
        first.handle.wait()
        with model.use(user):
            # The user drops the first unit's tensors: the allocator hands their blocks out
            # again on the user's stream while the second unit may still run.
            for tensor in [*inputs1, *(first.outputs or [])]:
                model.allocate(tensor, user, model._step(user), GPU)
            # The second unit's tensors are still in use by the NCCL stream.
            with pytest.raises(StreamViolation, match="record_stream"):
                model.allocate(inputs2[0], user, model._step(user), GPU)
        reused.set()

    engine_thread = threading.Thread(target=on_thread, args=(model, engine))
    engine_thread.start()
    try:
        on_thread(model, user_thread)
    finally:
        reused.set()
        engine_thread.join(30)
    assert second.handle.done()
