"""Fusion buffers of device units under the stream model (``tests/fakes/stream_model.py``).

Each device communicator runs its units on its own CUDA stream, and units of different
communicators are not ordered with each other: two process sets whose fused allreduces run
at the same time must not share a fusion buffer, and a buffer that is dropped (grown) must
not be handed out again while a stream may still use it.
"""

from __future__ import annotations

import pytest
import torch

from baguahvd.backends import nccl as backend
from baguahvd.engine.execution import execute
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


@pytest.fixture(params=[0, 1, 2])
def model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    return installed_model(monkeypatch, GPU, request.param)



class TwoSets:
    """Rank 0 of two process sets of two members, each with its own NCCL communicator."""

    def __init__(self) -> None:
        self.nccl = {ident: backend.NCCLCommunicator(fake_mpi.members(2)[0]) for ident in (1, 2)}
        states = {
            ident: ProcessSetState(ident, (0, 1), comm=object(), device_comm=comm)  # type: ignore[arg-type]
            for ident, comm in self.nccl.items()
        }
        self.dispatcher = Dispatcher(0, states)

    def fused(self, ident: int, name: str, *shapes: tuple[int, ...]) -> tuple[
        Request, list[tuple[Response, Request | None]]
    ]:
        """A fused allreduce of user tensors on set ``ident``, submitted on the current
        stream."""
        inputs = [torch.ones(shape, device=CUDA).mul_(ident) for shape in shapes]
        meta = RequestMeta(
            key=name, name=name, op=OpType.ALLREDUCE, process_set_id=ident, rank=0,
            dtype="float32", shapes=tuple(shapes), device="GPU",
        )
        request = Request(meta, inputs, [torch.empty_like(t) for t in inputs])
        self.dispatcher.submissions.mark(request)
        response = agreed(key=name, name=name, op=OpType.ALLREDUCE, process_set_id=ident,
                            dtype="float32", shapes=tuple(shapes), device="GPU")
        return request, [(response, request)]


def test_two_process_sets_running_fused_units_at_once_do_not_share_a_buffer(
    model: StreamModel,
) -> None:
    sets, user = TwoSets(), model.stream("user")
    with model.active(), model.use(user):
        first, unit1 = sets.fused(1, "a", (3,), (2,))
        second, unit2 = sets.fused(2, "b", (3,), (2,))

    def engine() -> None:
        # Launched back to back, as one cycle runs them: neither waits for the other.
        sets.dispatcher.run_unit(unit1)
        sets.dispatcher.run_unit(unit2)
        sets.dispatcher.pending.drain()

    on_thread(model, engine)
    with model.active(), model.use(user):
        for request in (first, second):
            request.handle.wait()
            for tensor in request.outputs or []:
                tensor.sum()
    ptrs = {call[2] for call in model.fake.log.work("allReduce")}
    assert len(ptrs) == 2  # one fusion buffer per communicator


def test_a_buffer_a_communicator_outgrows_may_be_handed_out_again_at_once(
    model: StreamModel,
) -> None:
    sets, user = TwoSets(), model.stream("user")
    with model.active(), model.use(user):
        small1, small2 = (sets.fused(ident, f"small{ident}", (2,), (2,)) for ident in (1, 2))
        large = sets.fused(1, "large", (64,), (64,))
    original = execute.FusionBuffers.get
    dropped: list[int] = []

    def get(self: execute.FusionBuffers, dtype: torch.dtype, count: int,
            device: torch.device, host: bool = False) -> torch.Tensor:
        old = self._buffers.get((dtype, device))
        buffer = original(self, dtype, count, device, host)
        if old is not None and self._buffers[(dtype, device)] is not old:
            # The caching allocator may hand the dropped block out again at once to the
            # next allocation on the stream it was allocated on.
            dropped.append(old.data_ptr())
            owner = next(s for s in model.streams.values()
                         if s.ident == model.buffer(old).stream)
            model.allocate(old, owner, model._step(owner), GPU)
        return buffer

    def engine() -> None:
        dispatcher = sets.dispatcher
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(execute.FusionBuffers, "get", get)
            dispatcher.run_unit(small1[1])
            dispatcher.pending.drain()
            dispatcher.run_unit(small2[1])  # still running when the first set grows
            dispatcher.run_unit(large[1])
        dispatcher.pending.drain()

    on_thread(model, engine)
    assert dropped  # the first set's buffer grew
    for request, _ in (small1, small2, large):
        assert request.handle.done()
