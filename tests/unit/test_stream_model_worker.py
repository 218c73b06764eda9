"""The algorithms' worker thread (``baguahvd.torch.algorithms.base.Worker``) with CUDA
tensors, on the stream model: the device it selects, the stream its communication runs on,
and the events that order that stream after the training stream's writes and the training
stream after the communication's results.

A job stands for a bucket's communication: it writes the bucket on the worker's current
stream, as the collectives it submits and the kernels around them would.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from baguahvd.backends import cuda_support
from baguahvd.runtime import runtime
from baguahvd.torch.algorithms.base import Worker
from baguahvd.torch.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from tests.fakes import gpu_job
from tests.fakes.stream_model import ModelStream, StreamModel, StreamViolation

pytestmark = pytest.mark.stream_model

GPU = 1
CUDA = f"cuda:{GPU}"


class _Engine:
    """What the worker's thread asks of the engine: the timeline activity of its jobs."""

    def activity(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    model = gpu_job.engine_model(monkeypatch, GPU)
    monkeypatch.setattr(runtime, "engine", _Engine())
    return model


@pytest.fixture
def worker(model: StreamModel) -> Iterator[Worker]:
    worker = Worker(GradientAllReduceAlgorithm())
    yield worker
    worker.close()


@pytest.fixture
def training(model: StreamModel) -> ModelStream:
    return model.stream("training")


def test_the_worker_thread_selects_the_tensors_gpu_once_before_its_first_job(
    model: StreamModel, worker: Worker, training: ModelStream
) -> None:
    seen: list[tuple[int, int]] = []

    def job() -> None:
        seen.append((model.torch_device(), model.cupy_device()))

    with model.active(), model.use(training):
        bucket = torch.ones(4, device=CUDA)
        worker.submit(job, bucket)
        worker.submit(job)  # a later job without a tensor: the thread keeps its GPU
        worker.wait()
    assert seen == [(GPU, GPU), (GPU, GPU)]


def test_communication_runs_on_the_workers_stream_and_skips_later_backward_kernels(
    model: StreamModel, worker: Worker, training: ModelStream
) -> None:
    model.cost = lambda name: {"mm": 10.0, "add_": 1.0}.get(name, 0.0)
    gate = threading.Event()
    ran: list[tuple[ModelStream, float]] = []

    def hold() -> None:
        gate.wait()

    def communicate() -> None:
        bucket.add_(1)
        ran.append((model.current(), model.current().free_at))

    with model.active(), model.use(training):
        bucket = torch.ones(4, device=CUDA).mul_(2)  # the gradients, packed
        worker.submit(hold)  # the worker takes the job once backward has gone on
        worker.submit(communicate, bucket)
        x = torch.ones(4, 4, device=CUDA)
        x.mm(x)  # the rest of backward, queued after the submission
        gate.set()
        worker.wait()
        bucket.mul_(3)  # the optimizer step reads the result: ordered after it
    stream, end = ran[0]
    assert stream is not training and stream.name == "side"
    assert end == 1.0, "the communication waited for the backward kernel queued after it"
    assert torch.equal(bucket, torch.full((4,), 9.0))


@pytest.mark.parametrize("dropped", ["producer", "consumer"])
def test_a_missing_event_wait_is_caught(
    model: StreamModel, worker: Worker, training: ModelStream,
    monkeypatch: pytest.MonkeyPatch, dropped: str,
) -> None:
    wait_event = cuda_support.wait_event

    def some_waits(device: torch.device, ptr: int, event: Any) -> None:
        # The worker's stream waits for the producer, the training stream for the consumer.
        if (ptr == training.ptr) != (dropped == "consumer"):
            wait_event(device, ptr, event)

    def communicate() -> None:
        bucket.add_(1)

    monkeypatch.setattr(cuda_support, "wait_event", some_waits)
    with model.active(), model.use(training):
        bucket = torch.ones(4, device=CUDA).mul_(2)
        worker.submit(communicate, bucket)
        with pytest.raises(StreamViolation):
            worker.wait()
            bucket.mul_(3)


def test_tensors_a_job_makes_are_recorded_for_the_stream_that_consumes_them(
    model: StreamModel, worker: Worker, training: ModelStream
) -> None:
    made: list[torch.Tensor] = []

    def job() -> list[torch.Tensor]:
        made.append(bucket.mul(2))  # allocated on the worker's stream
        return made

    with model.active(), model.use(training):
        bucket = torch.ones(4, device=CUDA)
        worker.submit(job, bucket)
        worker.wait()
        made[0].add_(1)  # used on the training stream
    assert training.ident in model.buffer(made[0]).recorded
