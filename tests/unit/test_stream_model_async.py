"""Async model averaging with CUDA parameters, on the stream model: a two-rank job whose
rank 0 trains through ``baguahvd.torch`` (``tests/fakes/gpu_job.py``) while its averaging
thread runs rounds over a private NCCL communicator of its own.

The other rank's model is a constant ``OTHER``: the fake NCCL's allreduce-SUM of a weight
snapshot ``s`` leaves ``s + OTHER``. The step size is zero, so only the averaging moves the
weights: every round halves their distance to ``OTHER``, and after ``k`` rounds the model
is ``OTHER + (w0 - OTHER) / 2**k`` exactly. A missing event between the training stream
and the averaging thread's stream, either way, raises :class:`StreamViolation`.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.backends import cuda_support
from baguahvd.backends import nccl as backend
from baguahvd.backends.base import Communicator
from baguahvd.common.exceptions import HorovodInternalError
from baguahvd.common.ops import ReduceOp
from baguahvd.runtime import runtime
from baguahvd.torch.algorithms.async_model_average import (
    AsyncModelAverageAlgorithm,
    AsyncModelAverageImpl,
)
from tests.fakes import fake_mpi, gpu_job
from tests.fakes.fake_cupy import NCCL_OPS, NCCL_TYPES
from tests.fakes.stream_model import ModelStream, StreamModel, StreamViolation
from tests.fakes.world import Job

pytestmark = pytest.mark.stream_model

GPU = 1
CUDA = f"cuda:{GPU}"
DIM = 8
OTHER = 1.0
"""Every weight of the other rank's model."""


class _Done:
    def test(self) -> bool:
        return True


class _HostComm:
    """A private host communicator whose peer votes and meets barriers as this rank does."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.freed = False

    def iallreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor,
                   op: ReduceOp) -> _Done:
        assert op is ReduceOp.MIN and tensor_in.numel() == 1
        return _Done()

    def ibarrier(self) -> _Done:
        return _Done()

    def free(self) -> None:
        self.freed = True


class _Private:
    """What the runtime hands the algorithm; records what it made."""

    def __init__(self) -> None:
        self.host: list[_HostComm] = []
        self.device: list[backend.NCCLCommunicator] = []
        self.threads: list[tuple[int, int, str]] = []

    def new_communicator(self, ranks: Any = None) -> _HostComm:
        self.host.append(_HostComm())
        return self.host[-1]

    def new_device_communicator(self, comm: Communicator) -> backend.NCCLCommunicator:
        assert comm is self.host[0]
        # Rank 0 of two: the first rank makes the unique id and needs nobody to create.
        self.device.append(backend.NCCLCommunicator(fake_mpi.members(2)[0]))
        return self.device[-1]


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    model = gpu_job.engine_model(monkeypatch, GPU)
    # The script selected its GPU in torch only (torch.cuda.set_device), not in CuPy.
    model._local.cupy_device = 0
    loop = AsyncModelAverageImpl._loop

    def averaging(impl: AsyncModelAverageImpl) -> None:
        with model.active():
            loop(impl)

    # The averaging thread queues its torch operations on the model as well.
    monkeypatch.setattr(AsyncModelAverageImpl, "_loop", averaging)
    communicator = model.fake.cupy.cuda.nccl.NcclCommunicator
    all_reduce = communicator.allReduce

    def other_rank_sends_other(self: Any, send: int, recv: int, count: int, dtype: int,
                               op: int, stream: int) -> None:
        all_reduce(self, send, recv, count, dtype, op, stream)
        # The snapshot's allreduce is the only one out of place.
        if send != recv and (dtype, op) == (NCCL_TYPES["NCCL_FLOAT32"], NCCL_OPS["NCCL_SUM"]):
            mine = np.ctypeslib.as_array((ctypes.c_float * count).from_address(send))
            total = np.ctypeslib.as_array((ctypes.c_float * count).from_address(recv))
            total[:] = mine + np.float32(OTHER)

    monkeypatch.setattr(communicator, "allReduce", other_rank_sends_other)
    return model


@pytest.fixture
def job(model: StreamModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    yield from gpu_job.training_job(monkeypatch)


@pytest.fixture
def private(model: StreamModel, monkeypatch: pytest.MonkeyPatch) -> _Private:
    private = _Private()
    monkeypatch.setattr(runtime, "new_communicator", private.new_communicator)
    monkeypatch.setattr(runtime, "new_device_communicator", private.new_device_communicator)
    monkeypatch.setattr(runtime, "mpi_threads_supported", lambda: True)
    round_ = AsyncModelAverageImpl._round

    def recorded(impl: AsyncModelAverageImpl) -> bool:
        private.threads.append((model.torch_device(), model.cupy_device(), model.current().name))
        return round_(impl)

    monkeypatch.setattr(AsyncModelAverageImpl, "_round", recorded)
    return private


def train(
    model: StreamModel, training: ModelStream, warmup_steps: int, rounds: int,
    host_waits: bool = True,
) -> tuple[torch.Tensor, torch.optim.Optimizer, AsyncModelAverageImpl]:
    """Steps with a zero step size until ``rounds`` averaging rounds ran, then aborts.

    ``host_waits``: the host waits for each step's loss, as a script that logs it does,
    which keeps the model's queues short; without it, every round sees unwaited steps.
    """
    with model.active(), model.use(training):
        weight = torch.zeros(DIM, device=CUDA).requires_grad_()
        algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=warmup_steps)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD([weight], lr=0.0), named_parameters=[("w", weight)],
            algorithm=algorithm,
        )
        impl = optimizer.algorithm_impl  # type: ignore[attr-defined]
        assert isinstance(impl, AsyncModelAverageImpl)
        deadline = time.monotonic() + 30
        try:
            while impl.rounds < rounds:
                assert time.monotonic() < deadline, f"only {impl.rounds} rounds in 30 s"
                optimizer.zero_grad()
                loss = (weight * torch.ones(DIM, device=CUDA)).sum()
                loss.backward()
                optimizer.step()
                if host_waits:
                    loss.item()
                time.sleep(0.001)
            algorithm.abort(optimizer)
        except BaseException:
            impl.close()
            raise
    return weight, optimizer, impl


def test_cuda_weights_are_averaged_on_a_private_nccl_communicator_and_stream(
    model: StreamModel, job: Job, private: _Private
) -> None:
    training = model.stream("training")
    weight, optimizer, impl = train(model, training, warmup_steps=1, rounds=3)
    try:
        with model.active(), model.use(training):
            expected = OTHER - OTHER / 2.0**impl.rounds
            assert torch.allclose(weight.detach(), torch.full((DIM,), expected, device=CUDA))
            weight.detach().add_(1)  # the training stream writes the weights again
        assert not impl.running
        (device_comm,) = private.device
        assert device_comm.device == torch.device(CUDA)  # made by the averaging thread
        private_stream = device_comm._stream.ptr
        snapshots = [call for call in model.fake.log.work("allReduce")
                     if call[-1] == private_stream]
        assert len(snapshots) == impl.rounds
        assert all(call[4] == DIM and call[6] == NCCL_OPS["NCCL_SUM"] for call in snapshots)
        engine_comm = job.engines[0].process_sets[0].device_comm
        assert isinstance(engine_comm, backend.NCCLCommunicator)
        assert engine_comm._stream.ptr != private_stream
        # The thread selected the parameters' GPU in torch and CuPy and ran on a stream of
        # its own.
        assert private.threads and set(private.threads) == {(GPU, GPU, "side")}
    finally:
        optimizer.close()  # type: ignore[attr-defined]
    assert all(comm.freed for comm in private.host)
    assert device_comm._handle is None


@pytest.mark.parametrize("dropped", ["training waits for the loop", "loop waits for training"])
def test_a_missing_wait_between_training_and_averaging_is_caught(
    model: StreamModel, job: Job, private: _Private, monkeypatch: pytest.MonkeyPatch,
    dropped: str,
) -> None:
    training = model.stream("training")
    wait_event = cuda_support.wait_event

    def some_waits(device: torch.device, ptr: int, event: Any) -> None:
        onto_training = ptr == training.ptr
        if onto_training != (dropped == "training waits for the loop"):
            wait_event(device, ptr, event)

    monkeypatch.setattr(cuda_support, "wait_event", some_waits)
    with pytest.raises((StreamViolation, HorovodInternalError)) as caught:
        weight, optimizer, impl = train(
            model, training, warmup_steps=0, rounds=3, host_waits=False
        )
        optimizer.close()  # type: ignore[attr-defined]
    error = caught.value
    assert isinstance(error, StreamViolation) or isinstance(error.__cause__, StreamViolation)
