"""GPU packaging and settings: the cuda12 extra, the NCCL timeout setting and where it goes,
and which submissions take a stream mark."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
import torch

from baguahvd.backends import nccl as backend
from baguahvd.backends.base import Communicator
from baguahvd.common.config import Config
from baguahvd.engine.dispatch import Dispatcher
from baguahvd.engine.intake import RequestQueue
from baguahvd.engine.messages import OpType
from baguahvd.engine.process_sets import ProcessSetState
from tests.fakes import fake_mpi
from tests.fakes.world import start_job

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

    dispatcher = Dispatcher(
        0, {}, RequestQueue(0), None, factory, lambda ranks: 0, lambda ident: None, 42.5,
        stopped,
    )
    state = ProcessSetState(0, (0, 1), comm=object())  # type: ignore[arg-type]
    made = dispatcher.device_comm(state, object())  # type: ignore[arg-type]
    assert isinstance(made, backend.NCCLCommunicator) and made.timeout_s == 42.5
    assert made.stopped is stopped


def test_a_single_member_set_takes_no_stream_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank runs in the caller's thread and stream: no CuPy, no event per submission."""

    def refuse(tensors: object) -> None:
        raise AssertionError("a single-member set marked its submission")

    monkeypatch.setattr(backend, "mark_submission", refuse)
    job = start_job(1)
    try:
        engine = job.engines[0]
        tensor = torch.ones(3)
        handle = engine.submit(OpType.ALLREDUCE, "allreduce", 0, [tensor], [tensor.clone()])
        assert handle.wait() is not None
    finally:
        job.close()
