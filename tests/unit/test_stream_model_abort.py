"""A device unit that fails writes nothing into the users' tensors (stream model).

When NCCL reports an error, a collective times out or the engine stops, the communicator is
aborted (``ncclCommAbort``) and the unit's handles fail. The kernels queued behind the NCCL
call on the communicator's stream still run after the abort, so whatever writes the users'
outputs from the communication's results (the copy out of the fusion buffer, the scaling
after the reduction) is queued only once the host has seen the communication finish without
error: the users' tensors keep what they held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from baguahvd.backends import nccl as backend
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.execution.completion import CollectiveFailure
from baguahvd.engine.execution.dispatch import Dispatcher
from baguahvd.engine.messages import OpType, RequestMeta, Response
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Request
from tests.fakes import fake_mpi
from tests.fakes.responses import agreed
from tests.fakes.stream_model import StreamModel, installed_model, on_thread

pytestmark = pytest.mark.stream_model

GPU = 1
CUDA = f"cuda:{GPU}"
SENTINEL = -1.0


@pytest.fixture(params=[0, 1, 2])
def model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    return installed_model(monkeypatch, GPU, request.param)


@pytest.fixture
def held(model: StreamModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """While the returned event is clear, no event of the model fires: launched units stay
    unfinished."""
    release = threading.Event()
    release.set()
    event_class = model.fake.cupy.cuda.Event
    done = event_class.done
    monkeypatch.setattr(event_class, "done", property(
        lambda event: release.is_set() and done.fget(event)
    ))
    yield release
    release.set()



class Rank:
    """Rank 0 of a process set of two whose device communicator is NCCL on the model."""

    def __init__(self) -> None:
        self.nccl = backend.NCCLCommunicator(fake_mpi.members(2)[0])
        state = ProcessSetState(0, (0, 1), comm=object(), device_comm=self.nccl)  # type: ignore[arg-type]
        self.dispatcher = Dispatcher(0, {0: state})

    def allreduce(self, name: str, *shapes: tuple[int, ...], **fields: object) -> tuple[
        Request, list[tuple[Response, Request | None]]
    ]:
        """An allreduce of user tensors (fused when several) into outputs that hold
        :data:`SENTINEL`, submitted on the current stream."""
        inputs = [torch.ones(shape, device=CUDA).mul_(2) for shape in shapes]
        outputs = [torch.full(shape, SENTINEL, device=CUDA) for shape in shapes]
        meta = RequestMeta(
            key=name, name=name, op=OpType.ALLREDUCE, process_set_id=0, rank=0,
            dtype="float32", shapes=tuple(shapes), device="GPU",
        )
        request = Request(meta, inputs, outputs)
        self.dispatcher.submissions.mark(request)
        response = agreed(key=name, name=name, op=OpType.ALLREDUCE, process_set_id=0,
                            dtype="float32", shapes=tuple(shapes), device="GPU",
                            **fields)  # type: ignore[arg-type]
        return request, [(response, request)]

    def warm_up(self) -> Callable[[], None]:
        """A first allreduce, which creates the NCCL communicator; the engine thread runs
        what this returns (it selects the GPU once per thread) before the test's units."""
        _, unit = self.allreduce("warm-up", (2,))

        def run() -> None:
            self.dispatcher.run_unit(unit)
            self.dispatcher.pending.drain()

        return run


def untouched(request: Request) -> bool:
    return all(t.eq(SENTINEL).all().item() for t in request.outputs or [])


UNITS = {
    "fused": ([(3,), (2, 2), (4,)], {}),
    "fused-scaled": ([(3,), (4,)], {"prescale": 0.5, "postscale": 3.0}),
    "fused-average": ([(3,), (4,)], {"reduce_op": ReduceOp.AVERAGE}),
    "postscaled": ([(5,)], {"postscale": 3.0}),
    "adasum": ([(4,), (3,)], {"reduce_op": ReduceOp.ADASUM}),
}


@pytest.mark.parametrize("case", sorted(UNITS))
def test_an_asynchronous_nccl_error_leaves_the_outputs_untouched(
    model: StreamModel, case: str
) -> None:
    shapes, fields = UNITS[case]
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        warm_up = rank.warm_up()
        request, unit = rank.allreduce("x", *shapes, **fields)
    failures: list[CollectiveFailure] = []

    def engine() -> None:
        warm_up()
        rank.dispatcher.run_unit(unit)
        model.fake.async_error = 6  # NCCL reports a failure of the unit's allreduce
        with pytest.raises(CollectiveFailure) as info:
            while True:
                rank.dispatcher.pending.poll()
        failures.append(info.value)

    on_thread(model, engine, grad_enabled=False)
    (failure,) = failures
    assert isinstance(failure.error, backend.NCCLError)
    assert model.fake.communicators[-1].aborted
    # Whatever the stream still runs after the abort, nothing was queued to write them.
    assert untouched(request)


def test_an_error_reported_after_the_communication_finished_still_stops_the_copy_out(
    model: StreamModel,
) -> None:
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        warm_up = rank.warm_up()
        request, unit = rank.allreduce("x", (3,), (4,), postscale=2.0)

    def engine() -> None:
        warm_up()
        rank.dispatcher.run_unit(unit)
        (pending,) = rank.dispatcher.pending._units
        model.synchronize(pending.launched.done.model)  # the NCCL part has finished ...
        model.fake.async_error = 6  # ... but NCCL reports that it failed
        with pytest.raises(CollectiveFailure):
            rank.dispatcher.pending.poll()

    on_thread(model, engine, grad_enabled=False)
    assert model.fake.communicators[-1].aborted
    assert untouched(request)


def test_a_unit_abandoned_when_the_engine_stops_leaves_the_outputs_untouched(
    model: StreamModel, held: threading.Event
) -> None:
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        warm_up = rank.warm_up()
        request, unit = rank.allreduce("x", (3,), (4,))

    def engine() -> None:
        warm_up()
        held.clear()  # the unit's allreduce waits for a peer
        rank.dispatcher.run_unit(unit)
        rank.dispatcher.pending.poll()
        rank.nccl.stopped = lambda: RuntimeError("rank 1 is gone")
        with pytest.raises(CollectiveFailure, match="rank 1 is gone"):
            rank.dispatcher.pending.poll()

    on_thread(model, engine, grad_enabled=False)
    assert model.fake.communicators[-1].aborted
    assert untouched(request)


def test_the_copy_out_follows_the_communication_on_its_stream(model: StreamModel) -> None:
    rank, user = Rank(), model.stream("user")
    with model.active(), model.use(user):
        units = [rank.allreduce(f"u{i}", (i + 2,), (3,), postscale=0.5) for i in range(3)]

    def engine() -> None:
        for _, unit in units:
            rank.dispatcher.run_unit(unit)
        rank.dispatcher.pending.drain()

    on_thread(model, engine, grad_enabled=False)
    with model.active(), model.use(user):
        for request, _ in units:
            results = request.handle.wait() or request.outputs or []
            for tensor in results:
                tensor.sum()  # read on the user's stream after the handle completed
                model.host_read(tensor)
            # The fake sends zeros for the peer: 2 * 0.5 on this rank.
            assert all(t.eq(1.0).all().item() for t in results)
