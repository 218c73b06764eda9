"""When each gradient bucket of DistributedOptimizer's default path starts and ends, on
every rank, over gloo: where a step's time goes beside the transfers themselves.

    benchmarks/emulated_cluster.sh --rate 1gbit -- python benchmarks/bucket_timeline.py
    mpirun -np 2 python benchmarks/bucket_timeline.py --steps 4       # one machine

The model and batch are ``algorithms.py``'s (the 33.6 MB MLP, SGD with momentum). For this
run only, the package's steps are wrapped with timestamps (``time.perf_counter``, one clock
for every process of the machine): a bucket handed to the engine (its last gradient is
ready), every engine cycle (each is one round of the ranks' bitwise AND over the control
plane), the start of the bucket's gloo allreduce, its end (the callback of gloo's future,
which fires in gloo's own thread as soon as the transfer ends) and the completion of its
handle (every completion is marked: the bucket's are those after its end). Per timed step,
each rank prints its events in ms from rank 0's step start, then a summary: per bucket the
delay from the later rank's submission to its start on this rank, the delay from the last
transfer's end to the next completion, and the cycles the engine ran while the transfers
were in flight.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("BAGUAHVD_CPU_BACKEND", "gloo")

import algorithms  # noqa: E402
import torch  # noqa: E402

import baguahvd.torch as hvd  # noqa: E402
from baguahvd.backends.gloo import communicator as gloo_comm  # noqa: E402
from baguahvd.engine import loop  # noqa: E402
from baguahvd.engine.execution import completion  # noqa: E402
from baguahvd.torch import buckets  # noqa: E402

_events: list[tuple[float, str]] = []


def _mark(what: str) -> None:
    _events.append((time.perf_counter(), what))


def _instrument() -> None:
    """Wraps the package's steps with :func:`_mark` (this process only)."""
    start = gloo_comm.GlooCommunicator.start_allreduce

    def start_allreduce(self: Any, tensor_in: Any, tensor_out: Any, op: Any) -> Any:
        _mark("start")
        work = start(self, tensor_in, tensor_out, op)
        work._work.get_future().add_done_callback(lambda _: _mark("end"))
        return work

    gloo_comm.GlooCommunicator.start_allreduce = start_allreduce  # type: ignore[method-assign]
    deliver = completion.deliver

    def delivered(outcomes: Any, timeline: Any = None) -> None:
        deliver(outcomes, timeline)
        _mark("completed")

    completion.deliver = delivered
    submit = buckets.bucket_allreduce_async_

    def bucket_submitted(*args: Any, **kwargs: Any) -> Any:
        _mark("submit")
        return submit(*args, **kwargs)

    buckets.bucket_allreduce_async_ = bucket_submitted
    cycle = loop.EngineLoop.cycle

    def cycled(self: Any) -> bool:
        _mark("cycle")
        return cycle(self)

    loop.EngineLoop.cycle = cycled  # type: ignore[method-assign]


def _summary(events: list[tuple[float, str]], theirs: list[list[float]]) -> str:
    """Per bucket: later submission -> start, end -> completed; cycles during transfers."""
    times = {kind: [t for t, what in events if what == kind]
             for kind in ("submit", "start", "end", "completed", "cycle")}
    parts = []
    for index, started in enumerate(times["start"]):
        submitted = max([times["submit"][index]] + [other[index] for other in theirs
                                                    if index < len(other)])
        parts.append(f"bucket {index}: start {1e3 * (started - submitted):.1f} ms after "
                     "the later submission")
    if times["end"]:
        last = max(times["end"])
        after = [t for t in times["completed"] if t >= last]
        if after:
            parts.append(f"last transfer's end -> its completion {1e3 * (after[0] - last):.1f} ms")
    if times["start"] and times["end"]:
        busy = [t for t in times["cycle"] if times["start"][0] <= t <= max(times["end"])]
        parts.append(f"{len(busy)} cycles during the transfers")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    _instrument()
    hvd.init()
    torch.set_num_threads(1)
    model = algorithms.build_model()
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        base, named_parameters=list(model.named_parameters()), algorithm=None
    )
    generator = torch.Generator().manual_seed(1 + hvd.rank())
    data = torch.randn(32, algorithms.MODEL_DIMS[0], generator=generator)
    target = torch.randint(0, algorithms.MODEL_DIMS[-1], (32,), generator=generator)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps: list[float] = []
    for index in range(args.warmup + args.steps):
        hvd.barrier()
        _events.clear()
        origin = hvd.broadcast_object(time.perf_counter(), 0)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(data), target).backward()
        _mark("backward done")
        optimizer.step()
        _mark("step done")
        steps.append(time.perf_counter() - start)
        events = list(_events)
        submits = [t for t, what in events if what == "submit"]
        everyone = hvd.allgather_object(submits)
        if index < args.warmup:
            continue
        line = "; ".join(f"{1e3 * (t - origin):.1f} {what}" for t, what in events)
        theirs = [other for rank, other in enumerate(everyone) if rank != hvd.rank()]
        print(f"rank {hvd.rank()} step {index}: {line}\n  {_summary(events, theirs)}",
              flush=True)
    if hvd.rank() == 0:
        print(f"median step {1e3 * statistics.median(steps[args.warmup:]):.1f} ms", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
