"""Compute/communication overlap, measured in the stream model's simulated time.

The model (``tests/fakes/stream_model.py``) gives every queued operation a duration and runs
streams side by side, so a training step has a simulated length: the backward pass's
kernels on the user's stream, the NCCL collectives on the communicator's stream, and
whatever orders one after the other. A DistributedOptimizer step whose allreduces overlap
the backward pass takes about as long as the longer of the two; one whose collectives hold
the user's stream (or whose engine waits for each collective before launching the next)
takes their sum.

The job (``tests/fakes/gpu_job.py``) is two engines over an in-memory control plane, each
with an NCCL communicator on the model. The training script runs on rank 0 through
``baguahvd.torch``; rank 1 submits, for every request of rank 0, the same collective on a
copy of its tensors (a peer running the same script). The host keeps pace with the GPU:
after each gradient's hook the script waits until the engine has launched that gradient's
allreduce before it queues the next layer's backward kernels, as a host whose kernel
launches take about as long as the kernels do. (A host far ahead of the GPU queues the
whole backward pass first and hides part of a missing overlap; this one shows all of it.)

With 20 gradients (39 matrix products of 1.0 in the backward pass, 20 allreduces of 2.0)
the step takes 42.0, 1.05 times the longer of the two. Run against the engine as it was
before units were launched without waiting (it waited for each unit before the next, and
made the submitting stream wait for it), the same test measured 77.0 to 79.0, 1.93 to 1.98
times: the sum, and it fails.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.backends import nccl as backend
from baguahvd.backends import nccl_setup
from baguahvd.common.exceptions import HorovodInternalError
from baguahvd.engine.engine import Engine
from baguahvd.engine.execution.completion import Completions
from baguahvd.engine.messages import OpType
from tests.fakes import gpu_job
from tests.fakes.stream_model import ModelStream, StreamModel
from tests.fakes.world import Job

pytestmark = pytest.mark.stream_model

GPU = 1
CUDA = f"cuda:{GPU}"
LAYERS = 20
WIDTH = 8
MATMUL = 1.0
"""Simulated duration of one matrix product (the backward pass's kernels)."""
ALLREDUCE = 2.0
"""Simulated duration of one NCCL allreduce (one gradient, one bucket)."""
BOUND = 1.2
"""The step must take at most this many times the longer of compute and communication."""


def test_the_model_runs_streams_side_by_side_and_events_order_them(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    model = StreamModel(device=GPU)
    model.install(monkeypatch)
    model.main_thread()
    model.cost = lambda name: {"mm": 3.0, "add_": 1.0}.get(name, 0.0)
    compute, other = model.stream("compute"), model.stream("other")
    with model.active():
        with model.use(compute):
            a = torch.ones(2, 2, device=CUDA)
            b = a.mm(a)
        with model.use(other):
            c = torch.ones(2, 2, device=CUDA).add_(1)
        assert (compute.free_at, other.free_at) == (3.0, 1.0)  # concurrent
        event = model.fake.cupy.cuda.Event()
        model.record(event.model, compute)
        model.wait(other, event.model)
        with model.use(other):
            c.add_(b)  # starts when the product is done
        assert other.free_at == 4.0 and other.busy == 2.0
    model.synchronize(event.model)
    assert model.host_time() == 3.0
    with model.active(), model.use(other):
        c.add_(1)  # queued after the host waited: ordered after the wait anyway
    assert other.free_at == 5.0


# ---------------------------------------------------------------------------------------
# A DistributedOptimizer step


@dataclasses.dataclass
class Step:
    """What one step of the job measured, in simulated time."""

    backward: float
    communication: float
    length: float

    @property
    def ratio(self) -> float:
        return self.length / max(self.backward, self.communication)


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    return gpu_job.engine_model(monkeypatch, GPU)


@pytest.fixture
def job(model: StreamModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    yield from gpu_job.training_job(monkeypatch)


def nccl_stream(model: StreamModel, job: Job) -> ModelStream:
    """Rank 0's NCCL stream, made at its first collective."""
    comm = job.engines[0].process_sets[0].device_comm
    assert isinstance(comm, backend.NCCLCommunicator)
    return model.streams[comm._stream.ptr]


def train_step(model: StreamModel, job: Job) -> Step:
    """Forward, backward and optimizer step of a chain of ``LAYERS`` matrix products; every
    weight's gradient is one allreduce."""
    user = model.stream("user")
    with model.active(), model.use(user):
        weights = [torch.randn(WIDTH, WIDTH, device=CUDA).div_(WIDTH).requires_grad_()
                   for _ in range(LAYERS)]
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(weights, lr=0.1),
            named_parameters=[(f"w{i}", w) for i, w in enumerate(weights)],
        )
        # As a training script does before its first step; this creates (and warms up)
        # the NCCL communicator, outside the timed step.
        hvd.broadcast_parameters({f"w{i}": w for i, w in enumerate(weights)}, root_rank=0)
        launched = [0]
        nccl_calls = model.fake.log

        def keep_pace(weight: torch.Tensor) -> None:
            # The host queues the next layer's kernels once this gradient's allreduce is
            # launched (see module docstring).
            launched[0] += 1
            deadline = time.monotonic() + 30
            while sum(1 for call in nccl_calls.work("allReduce") if call[1] == 0) < launched[0]:
                assert time.monotonic() < deadline, "the engine did not launch the allreduce"
                time.sleep(0.0005)

        for weight in weights:
            weight.register_post_accumulate_grad_hook(keep_pace)
        x = torch.randn(4, WIDTH, device=CUDA)
        for weight in weights:
            x = x.mm(weight)
        loss = x.sum()
        start = user.free_at
        model.cost = lambda name: {"mm": MATMUL, "nccl.allReduce": ALLREDUCE}.get(name, 0.0)
        before = user.busy
        loss.backward()
        backward = user.busy - before
        optimizer.step()
        model.cost = lambda name: 0.0
        nccl = nccl_stream(model, job)
        end = max(user.free_at, nccl.free_at)
        communication = nccl.busy
    return Step(backward, communication, end - start)


def test_a_distributed_optimizer_step_overlaps_backward_and_allreduces(
    model: StreamModel, job: Job
) -> None:
    step = train_step(model, job)
    assert step.backward == (2 * LAYERS - 1) * MATMUL
    assert step.communication == LAYERS * ALLREDUCE
    assert step.ratio <= BOUND, step


# ---------------------------------------------------------------------------------------
# The engine with launched units: the end of the job, failures


def allreduce(model: StreamModel, engine: Engine, name: str) -> Any:
    """An allreduce of a tensor written on this thread's own stream; returns its handle."""
    with model.active(), model.use(model.stream(f"user{engine.rank}")):
        tensor = torch.ones(4, device=CUDA).mul_(engine.rank + 1)
        return engine.submit(OpType.ALLREDUCE, "allreduce", 0, [tensor], [tensor], name=name)


def hold_events(model: StreamModel, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Completion events answer "not yet" until the returned flag is set; the event of a
    new communicator's warm-up allreduce answers as it would."""
    fire = threading.Event()
    event_class = model.fake.cupy.cuda.Event
    done = event_class.done
    # The warm-up events themselves, not their ids: a freed event's id can come back as the
    # id of a later completion event.
    warm_ups: list[Any] = []
    helper_run = nccl_setup._Helper.run

    def run(helper: nccl_setup._Helper) -> None:
        helper_run(helper)
        warm_ups.append(helper.warmed)

    monkeypatch.setattr(nccl_setup._Helper, "run", run)
    monkeypatch.setattr(event_class, "done", property(
        lambda event: (fire.is_set() or any(event is w for w in warm_ups)) and done.fget(event)
    ))
    return fire


def launched(model: StreamModel, count: int) -> None:
    """Waits until ``count`` NCCL allreduces were launched (every rank's)."""
    deadline = time.monotonic() + 30
    while len(model.fake.log.work("allReduce")) < count:
        assert time.monotonic() < deadline, "the allreduces were not launched"
        time.sleep(0.001)


def test_units_still_running_at_a_normal_shutdown_complete_first(
    model: StreamModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    fire = hold_events(model, monkeypatch)
    drain = Completions.drain

    def drain_then(completions: Completions) -> None:
        fire.set()  # the units finish while the engine waits for them
        drain(completions)

    monkeypatch.setattr(Completions, "drain", drain_then)
    job = gpu_job.nccl_job()
    handles = job.run(lambda rank, engine: allreduce(model, engine, "x"))
    launched(model, 2)
    assert not any(handle.done() for handle in handles)
    job.close()
    for handle in handles:
        handle.wait()  # completed, not failed by the shutdown


def test_a_launched_unit_past_the_timeout_fails_its_handles_on_every_rank(
    model: StreamModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold_events(model, monkeypatch)
    job = gpu_job.nccl_job(nccl_timeout_s=0.2)
    try:
        handles = job.run(lambda rank, engine: allreduce(model, engine, "x"))
        for handle in handles:
            with pytest.raises(HorovodInternalError):
                handle.wait()
        errors = [handle.error for handle in handles]
        assert any(isinstance(error, backend.NCCLTimeoutError) for error in errors)
        for engine in job.engines:
            assert engine._thread is not None
            engine._thread.join(10)
            assert not engine.running
        comms = [engine.process_sets[0].device_comm for engine in job.engines]
        assert all(isinstance(comm, backend.NCCLCommunicator) and comm._handle is None
                   for comm in comms)  # aborted
    finally:
        job.world.close()
