"""Device units that have no stream of their own, under the stream model: gloo carrying CUDA
tensors through host memory (HOROVOD_GPU_OPERATIONS=GLOO) and a single-member set's identity
path. Both queue their work on the engine's or the submitter's current stream; the results
must still be ready for any stream, and the host, once the handle's wait returns."""

from __future__ import annotations

import pytest
import torch

from baguahvd.backends import cuda_support
from baguahvd.backends.base import SelfCommunicator
from baguahvd.engine.execution.dispatch import Dispatcher
from baguahvd.engine.messages import OpType, RequestMeta, Response
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Request
from tests.fakes.responses import agreed
from tests.fakes.stream_model import StreamModel, installed_model, on_thread
from tests.unit.test_stream_model import CUDA, GPU, SEEDS

pytestmark = pytest.mark.stream_model


@pytest.fixture(params=SEEDS)
def model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    return installed_model(monkeypatch, GPU, request.param)


class _HostStaged(SelfCommunicator):
    """A two-member communicator that moves CUDA tensors with plain torch copies on the
    calling thread's current stream, as gloo does with host memory; no ``ordered``."""

    rank, size = 0, 2

    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: object) -> None:
        tensor_out.copy_(tensor_in.clone())


def _request(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> Request:
    meta = RequestMeta(
        key="allreduce.t", name="allreduce.t", op=OpType.ALLREDUCE, process_set_id=0, rank=0,
        dtype="float32", shapes=tuple(tuple(t.shape) for t in inputs), device="GPU",
    )
    return Request(meta, inputs, outputs)


def _response(shapes: tuple[tuple[int, ...], ...]) -> Response:
    return agreed(key="allreduce.t", name="allreduce.t", op=OpType.ALLREDUCE,
                    process_set_id=0, dtype="float32", shapes=shapes, device="GPU")


def test_a_host_staged_unit_waits_for_the_producer_and_for_its_own_copies(
    model: StreamModel,
) -> None:
    comm = _HostStaged()
    state = ProcessSetState(0, (0, 1), comm=comm)  # type: ignore[arg-type]
    dispatcher = Dispatcher(0, {0: state}, None, lambda c: c)
    side = model.stream("side")
    with model.active(), model.use(side):
        inputs = [torch.ones(4, device=CUDA).mul_(3)]
        outputs = [torch.empty(4, device=CUDA)]
        request = _request(inputs, outputs)
        dispatcher.submissions.mark(request)
    on_thread(model, lambda: dispatcher.run_unit([(_response(((4,),)), request)]))
    with model.active():
        request.handle.wait()
        assert model.settled_for(outputs[0], model.default)
        model.host_read(outputs[0])
        assert float(outputs[0].sum()) == 12.0  # on the default stream, not the producer's


def test_a_single_member_sets_cuda_result_is_ready_after_the_wait(model: StreamModel) -> None:
    state = ProcessSetState(0, (0,), comm=SelfCommunicator())  # type: ignore[arg-type]
    dispatcher = Dispatcher(0, {0: state})
    side = model.stream("side")
    with model.active(), model.use(side):
        inputs = [torch.ones(4, device=CUDA).mul_(3)]
        outputs = [torch.empty(4, device=CUDA)]
        request = _request(inputs, outputs)
        dispatcher.run_alone(request, state)
    with model.active():
        request.handle.wait()
        assert model.settled_for(outputs[0], model.default)
        model.host_read(outputs[0])
        assert float(outputs[0].sum()) == 12.0


def test_without_cupy_a_single_member_set_waits_on_a_torch_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A job of one rank needs no CuPy for CUDA tensors: the result's event is torch's then.
    recorded: list[object] = []

    class TorchEvent:
        def record(self, stream: object) -> None:
            recorded.append(stream)

    def no_cupy() -> None:
        raise cuda_support.NCCLUnavailableError("CuPy is not installed")

    monkeypatch.setattr(cuda_support, "import_cupy", no_cupy)
    monkeypatch.setattr(cuda_support, "current_stream_ptr", lambda device: 0x70)
    monkeypatch.setattr(torch.cuda, "Event", TorchEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream", device))
    event = cuda_support.current_stream_done(torch.device("cuda", 0))
    assert isinstance(event, TorchEvent)
    assert recorded == [("stream", torch.device("cuda", 0))]
