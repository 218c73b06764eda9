"""A two-rank GPU job in one process, on the stream model: real engines, NCCL communicators
on the model's fake CuPy, and ``baguahvd.torch`` driven from the test's thread as rank 0.

Rank 1 is a peer running the same script: for every request rank 0 submits, it submits the
same collective on a copy of the tensors (made on rank 0's stream, as the peer's own
kernels would be). Its results are not looked at; its collectives make the negotiation
agree and occupy its own NCCL stream.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from baguahvd.backends import nccl as backend
from baguahvd.engine.engine import Engine
from baguahvd.runtime import global_process_set, runtime
from baguahvd.torch.algorithms.base import Worker
from tests.fakes import fake_mpi
from tests.fakes.stream_model import HOST, StreamModel, installed_model
from tests.fakes.world import Job, start_job


def engine_model(monkeypatch: pytest.MonkeyPatch, device: int) -> StreamModel:
    """A stream model installed for the NCCL backend, whose engine and algorithm worker
    threads run on it too."""
    model = installed_model(monkeypatch, device)
    original = Engine._run

    def run(engine: Engine) -> None:
        with model.active():
            original(engine)

    # The engine threads queue their torch operations on the model as well.
    monkeypatch.setattr(Engine, "_run", run)
    run_jobs = Worker._run_jobs

    def jobs(worker: Worker) -> None:
        with model.active():
            run_jobs(worker)

    # So do the algorithms' worker threads.
    monkeypatch.setattr(Worker, "_run_jobs", jobs)
    # The engine tells GPU requests from CPU ones by Tensor.is_cuda.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: model.device_of(t) != HOST))
    return model


def nccl_job(**config: Any) -> Job:
    """Two engines whose device communicators are NCCL communicators on the model."""
    members = fake_mpi.members(2, wait_s=30.0)

    def factory(rank: int) -> Callable[[Any], backend.NCCLCommunicator]:
        return lambda comm: backend.NCCLCommunicator(members[rank])

    return start_job(2, device_comms=factory, **config)


def training_job(monkeypatch: pytest.MonkeyPatch, **config: Any) -> Iterator[Job]:
    """A fixture's body: :func:`nccl_job` with ``baguahvd.torch`` pointed at rank 0 and rank
    1 mirroring its requests (module docstring); shuts the job down at the end."""
    job = nccl_job(**config)
    engine, peer = job.engines
    topology = types.SimpleNamespace(
        rank=0, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1,
        is_homogeneous=True,
    )
    monkeypatch.setattr(runtime, "engine", engine)
    monkeypatch.setattr(runtime, "topology", topology)
    monkeypatch.setattr(runtime, "config", engine.config)
    monkeypatch.setattr(global_process_set, "process_set_id", 0)
    monkeypatch.setattr(global_process_set, "ranks", [0, 1])
    monkeypatch.setattr(global_process_set, "_registry", runtime)
    peer_handles: list[Any] = []
    last_of_name: dict[str, Any] = {}
    submit = engine.submit

    def mirrored(op: Any, label: str, ident: int, inputs: Any, outputs: Any,
                 *args: Any, **kwargs: Any) -> Any:
        name = kwargs.get("name", args[0] if args else None)
        if name in last_of_name:
            # Rank 0 waited for its previous collective of this name before reusing the
            # name; so does the peer running the same script.
            last_of_name[name].wait()
        copies = [t.clone() for t in inputs]
        handle = peer.submit(
            op, label, ident, copies, None if outputs is None else copies, *args, **kwargs
        )
        peer_handles.append(handle)
        if name is not None:
            last_of_name[name] = handle
        return submit(op, label, ident, inputs, outputs, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", mirrored)
    try:
        yield job
    finally:
        for handle in peer_handles:
            handle.wait()
        job.close()
