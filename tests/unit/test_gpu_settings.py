"""GPU packaging and settings: the cuda12 extra, the NCCL timeout setting and where it goes,
and which submissions take a stream mark."""

from __future__ import annotations

import configparser
import contextlib
from pathlib import Path

import pytest
import torch

from baguahvd.backends import cuda_support
from baguahvd.backends import nccl as backend
from baguahvd.backends.base import Communicator
from baguahvd.common.config import Config
from baguahvd.engine.execution.dispatch import Dispatcher
from baguahvd.engine.messages import OpType
from baguahvd.engine.process_sets import ProcessSetState
from tests.fakes import fake_mpi
from tests.fakes.fake_cupy import FakeCupy
from tests.fakes.world import start_job
from tests.support.jobs import run_one_rank

ROOT = Path(__file__).resolve().parents[2]


def test_the_cuda12_extra_brings_cupy_nccl_and_nvrtc() -> None:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    extra = setup["options.extras_require"]["cuda12"]
    names = {line.split(";")[0].split(">")[0].strip() for line in extra.splitlines() if line}
    assert {"cupy-cuda12x", "nvidia-nccl-cu12", "nvidia-cuda-nvrtc-cu12"} <= names


def test_the_nccl_timeout_is_a_setting() -> None:
    assert Config.from_env({}).nccl_timeout_s == backend.DEFAULT_TIMEOUT_S
    assert Config.from_env({"BAGUAHVD_NCCL_TIMEOUT_SECONDS": "42.5"}).nccl_timeout_s == 42.5
    with pytest.raises(ValueError, match="BAGUAHVD_NCCL_TIMEOUT_SECONDS"):
        Config.from_env({"BAGUAHVD_NCCL_TIMEOUT_SECONDS": "0"})


def test_device_communicators_get_the_timeout_and_the_engines_stop_state() -> None:
    def factory(comm: Communicator) -> Communicator:
        return backend.NCCLCommunicator(fake_mpi.members(2)[0])

    def stopped() -> BaseException | None:
        return None

    dispatcher = Dispatcher(0, {}, None, factory, device_timeout_s=42.5, stopped=stopped)
    state = ProcessSetState(0, (0, 1), comm=object())  # type: ignore[arg-type]
    made = dispatcher.device_comm(state, object())  # type: ignore[arg-type]
    assert isinstance(made, backend.NCCLCommunicator) and made.timeout_s == 42.5
    assert made.stopped is stopped


def test_a_single_member_set_takes_no_stream_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank runs in the caller's thread and stream: no CuPy, no event per submission."""

    def refuse(tensors: object) -> None:
        raise AssertionError("a single-member set marked its submission")

    monkeypatch.setattr(cuda_support, "mark_submission", refuse)
    job = start_job(1)
    try:
        engine = job.engines[0]
        tensor = torch.ones(3)
        handle = engine.submit(OpType.ALLREDUCE, "allreduce", 0, [tensor], [tensor.clone()])
        assert handle.wait() is not None
    finally:
        job.close()


def test_single_rank_nccl_is_a_setting() -> None:
    assert Config.from_env({}).nccl_single_rank is False
    assert Config.from_env({"BAGUAHVD_NCCL_SINGLE_RANK": "1"}).nccl_single_rank is True


@pytest.mark.parametrize("through_nccl", [False, True], ids=["default", "single-rank-nccl"])
def test_single_rank_nccl_routes_a_one_rank_allreduce_through_nccl(
    monkeypatch: pytest.MonkeyPatch, through_nccl: bool
) -> None:
    fake = FakeCupy()
    fake.install(monkeypatch)
    device = torch.device("cuda", 0)
    monkeypatch.setattr(cuda_support, "tensor_device", lambda tensor: device)
    monkeypatch.setattr(cuda_support, "current_stream_ptr", lambda device: 0x7070)
    monkeypatch.setattr(cuda_support, "set_torch_device", lambda device: None)
    monkeypatch.setattr(cuda_support, "on_stream", lambda device, ptr: contextlib.nullcontext())
    monkeypatch.setattr(cuda_support, "record_stream", lambda tensor, device, ptr: None)
    marks: list[object] = []

    def mark(tensors: list[torch.Tensor]) -> backend.StreamMark:
        made = backend.StreamMark(device, 0x7070, fake.cupy.cuda.Event())
        marks.append(made)
        return made

    monkeypatch.setattr(cuda_support, "mark_submission", mark)
    job = start_job(1, nccl_single_rank=through_nccl)
    try:
        tensor, output = torch.arange(3.0), torch.zeros(3)
        handle = job.engines[0].submit(OpType.ALLREDUCE, "allreduce", 0, [tensor], [output])
        (result,) = handle.wait()
        # The fake NCCL moves no bytes: only the identity path copies the input over.
        assert torch.equal(result, torch.zeros(3) if through_nccl else tensor)
    finally:
        job.close()
    reduced = [call for call in fake.log.of("allReduce") if call[4] == 3]
    if through_nccl:
        assert len(marks) == 1 and len(fake.log.of("NcclCommunicator")) == 1
        assert reduced and reduced[0][1] == 0  # rank 0 of a one-rank communicator
        assert reduced[0][2:4] == (tensor.data_ptr(), output.data_ptr())
        assert fake.log.of("NcclCommunicator")[0][1] == 1
    else:
        assert marks == [] and fake.log == []


@pytest.mark.parametrize("single_rank_nccl", ["0", "1"])
def test_single_rank_nccl_binds_the_bagua_algorithm_at_one_rank(single_rank_nccl: str) -> None:
    """One rank leaves the optimizer alone, unless BAGUAHVD_NCCL_SINGLE_RANK asks for the
    GPU path to be exercised: then the algorithm communicates at size 1 too, and trains."""
    run_one_rank(
        f"""
        hvd.init()
        model = torch.nn.Linear(4, 2)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(), algorithm="bytegrad")
        assert (optimizer.algorithm_impl is not None) == {single_rank_nccl == "1"}
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            optimizer.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        hvd.shutdown()
        """,
        BAGUAHVD_NCCL_SINGLE_RANK=single_rank_nccl,
    )
