"""Collectives and CUDA graphs.

A collective cannot be captured in a CUDA graph (it is negotiated and launched by the engine
thread, not replayed), so one submitted while the submitting thread's current stream is
capturing is refused with :class:`CudaGraphCaptureError` instead of being queued. And the
threads of baguahvd that talk to CUDA (the engine thread polling completion events, NCCL
setup helpers) must not break a capture in another thread: torch captures in CUDA's global
mode by default, where an event query from a thread whose own mode is global invalidates
the capture, so they switch themselves to the relaxed mode
(:func:`baguahvd.backends.cuda_support.relax_capture_mode`) before their first CUDA call.
"""

from __future__ import annotations

import ctypes
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.backends import cuda_support
from baguahvd.common.exceptions import CudaGraphCaptureError, HorovodInternalError
from baguahvd.engine.messages import OpType
from baguahvd.runtime import global_process_set, runtime
from tests.fakes import gpu_job
from tests.fakes.stream_model import StreamModel

GPU = 1
CUDA = f"cuda:{GPU}"


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    return gpu_job.engine_model(monkeypatch, GPU)


@pytest.fixture
def capturing(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[int]]:
    """The threads (by ident) whose current stream is capturing a graph."""
    threads: set[int] = set()
    monkeypatch.setattr(cuda_support, "stream_capturing",
                        lambda: threading.get_ident() in threads)
    yield threads


def submit(model: StreamModel, engine: Any, name: str | None, ident: int = 0) -> Any:
    with model.active():
        tensor = torch.ones(4, device=CUDA)
        return engine.submit(OpType.ALLREDUCE, "allreduce", ident, [tensor], [tensor], name=name)


# ---------------------------------------------------------------------------------------
# Submitting while capturing


@pytest.mark.stream_model
def test_a_collective_submitted_during_a_capture_is_refused_and_not_queued(
    model: StreamModel, capturing: set[int]
) -> None:
    job = gpu_job.nccl_job()
    try:
        engine = job.engines[0]
        capturing.add(threading.get_ident())
        with pytest.raises(CudaGraphCaptureError, match="cannot be captured in a CUDA graph"):
            submit(model, engine, None)
        assert isinstance(CudaGraphCaptureError("x"), ValueError)
        capturing.clear()
        # Nothing was queued and no unnamed key was used: the next unnamed collective of
        # each rank pairs with the other's.
        handles = job.run(lambda rank, engine: submit(model, engine, None))
        for handle in handles:
            handle.wait()
        assert len(model.fake.log.work("allReduce")) == 2
    finally:
        job.close()


@pytest.mark.stream_model
def test_a_single_member_collective_during_a_capture_is_refused(
    model: StreamModel, capturing: set[int]
) -> None:
    job = gpu_job.nccl_job()
    try:
        ident = job.engines[0].register_process_set([0])
        capturing.add(threading.get_ident())
        with pytest.raises(CudaGraphCaptureError):
            submit(model, job.engines[0], "alone", ident)
    finally:
        capturing.clear()
        job.close()


@pytest.mark.stream_model
def test_the_peer_of_a_rank_that_refused_a_captured_collective_gets_an_error(
    model: StreamModel, capturing: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = gpu_job.nccl_job()
    try:
        engine, peer = job.engines
        topology = types.SimpleNamespace(rank=0, size=2, local_rank=0, local_size=2)
        monkeypatch.setattr(runtime, "engine", engine)
        monkeypatch.setattr(runtime, "topology", topology)
        monkeypatch.setattr(runtime, "config", engine.config)
        monkeypatch.setattr(global_process_set, "process_set_id", 0)
        monkeypatch.setattr(global_process_set, "ranks", [0, 1])
        handle = submit(model, peer, "captured")
        capturing.add(threading.get_ident())
        with model.active():
            tensor = torch.ones(4, device=CUDA)
            with pytest.raises(CudaGraphCaptureError):
                hvd.allreduce(tensor, name="captured")
        capturing.clear()
        # Rank 1 fails with rank 0's reason instead of waiting for it.
        with pytest.raises(HorovodInternalError, match="cannot be captured in a CUDA graph"):
            handle.wait()
    finally:
        capturing.clear()
        job.close()


def test_nothing_is_capturing_without_cuda() -> None:
    assert cuda_support.stream_capturing() is (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    )


# ---------------------------------------------------------------------------------------
# Our threads in the relaxed capture mode


class Driver:
    """``libcuda.so.1`` as ctypes sees it: records the modes it is given."""

    def __init__(self, status: int = 0) -> None:
        self.modes: list[int] = []
        self.status = status

    def cuThreadExchangeStreamCaptureMode(self, mode: Any) -> int:  # noqa: N802 - CUDA's name
        pointer = ctypes.cast(mode, ctypes.POINTER(ctypes.c_int))
        self.modes.append(pointer.contents.value)
        pointer.contents.value = 0  # the previous mode: global
        return self.status


def test_relax_capture_mode_sets_the_relaxed_mode_through_the_driver(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = Driver()
    monkeypatch.setattr(cuda_support, "_cuda_driver", lambda: driver)
    assert cuda_support.relax_capture_mode()
    # cudaStreamCaptureModeRelaxed (as cupy.cuda.runtime.streamCaptureModeRelaxed)
    assert driver.modes == [2]


def test_relax_capture_mode_says_when_cuda_is_not_initialized_yet(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = Driver(status=3)  # CUDA_ERROR_NOT_INITIALIZED
    monkeypatch.setattr(cuda_support, "_cuda_driver", lambda: driver)
    assert not cuda_support.relax_capture_mode()


def test_relax_capture_mode_is_a_no_op_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert not cuda_support.relax_capture_mode()


@pytest.mark.stream_model
def test_the_engine_thread_relaxes_its_capture_mode_before_its_first_event_query(
    model: StreamModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str]] = []
    lock = threading.Lock()

    def relax() -> bool:
        with lock:
            calls.append(("relax", threading.current_thread().name))
        return True

    monkeypatch.setattr(cuda_support, "relax_capture_mode", relax)
    event_class = model.fake.cupy.cuda.Event
    done = event_class.done

    def query(event: Any) -> bool:
        with lock:
            calls.append(("query", threading.current_thread().name))
        return bool(done.fget(event))

    monkeypatch.setattr(event_class, "done", property(query))
    job = gpu_job.nccl_job()
    try:
        handles = job.run(lambda rank, engine: submit(model, engine, "x"))
        for handle in handles:
            handle.wait()
    finally:
        job.close()
    pollers = {name for what, name in calls if what == "query"}
    assert any(name.startswith("baguahvd-engine") for name in pollers)
    for name in pollers - {threading.current_thread().name}:
        assert calls.index(("relax", name)) < calls.index(("query", name)), name
    relaxed = {name for what, name in calls if what == "relax"}
    assert "baguahvd-nccl-setup" in relaxed
