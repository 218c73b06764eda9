"""The GPU path under the stream model (``tests/fakes/stream_model.py``).

The first tests show that the model catches each kind of ordering bug. The others run the
engine's dispatcher and the NCCL backend the way a rank does: the user thread writes its
tensors on its own stream and submits them, an engine thread runs the agreed unit, and the
user reads the results on its stream (or on the host) after waiting on the handle. A missing
event, a wrong device or a result completed too early raises :class:`StreamViolation`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from baguahvd.backends import nccl as backend
from baguahvd.common.ops import ReduceOp
from baguahvd.engine import execute
from baguahvd.engine.dispatch import Dispatcher
from baguahvd.engine.intake import RequestQueue
from baguahvd.engine.messages import OpType, RequestMeta, Response
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Request
from tests.fakes import fake_mpi
from tests.fakes.stream_model import HOST, ModelEvent, StreamModel, StreamViolation

pytestmark = pytest.mark.stream_model

GPU = 1
"""The process's GPU: not 0, so that anything that falls back to GPU 0 shows."""
CUDA = f"cuda:{GPU}"
SEEDS = [0, 1, 2]


@pytest.fixture(params=SEEDS)
def model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    model = StreamModel(device=GPU, seed=request.param)
    model.install(monkeypatch, backend)
    model.main_thread()
    return model


def on_thread(model: StreamModel, body: Callable[[], object]) -> None:
    """Runs ``body`` on a new thread (as the engine thread does), re-raising its error."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            with model.active():
                body()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]


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
        self.dispatcher = Dispatcher(
            0, {0: state}, RequestQueue(0), None, None, lambda ranks: 0, lambda ident: None
        )

    def submit(self, op: OpType, inputs: list[torch.Tensor],
               outputs: list[torch.Tensor] | None, **fields: object) -> Request:
        meta = RequestMeta(
            key=f"{op.name}.t", name=f"{op.name}.t", op=op, process_set_id=0, rank=0,
            dtype=execute.dtype_name(inputs[0].dtype) if inputs else "",
            shapes=tuple(tuple(t.shape) for t in inputs), device="GPU",
        )
        request = Request(meta, inputs, outputs)
        self.dispatcher.mark(request)
        return request

    def run(self, model: StreamModel, entries: list[tuple[Response, Request | None]]) -> None:
        """Launches the unit and completes it, as the engine thread does."""

        def engine() -> None:
            self.dispatcher.run_unit(entries)
            self.dispatcher.pending.drain()

        on_thread(model, engine)


def response(op: OpType, shapes: tuple[tuple[int, ...], ...], **fields: object) -> Response:
    return Response(key=f"{op.name}.t", name=f"{op.name}.t", op=op, process_set_id=0,
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
        outputs = [torch.empty_like(t) for t in inputs] if op != OpType.ALLGATHER else None
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
    assert rank.dispatcher.user_device == torch.device("cuda", GPU)
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
    # The user drops the output; the allocator hands its block to the NCCL stream again.
    nccl_stream = model.streams[rank.nccl._stream.ptr]
    model.allocate(output, nccl_stream, model._step(nccl_stream), GPU)
