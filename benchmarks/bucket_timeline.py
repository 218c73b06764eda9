"""When each gradient bucket of DistributedOptimizer's default path starts and ends, on
every rank, over gloo: where a step's time goes beside the transfers themselves.

    benchmarks/emulated_cluster.sh --rate 1gbit -- python benchmarks/bucket_timeline.py
    mpirun -np 2 python benchmarks/bucket_timeline.py --steps 4       # one machine
    ... python benchmarks/bucket_timeline.py --ddp                    # torch DDP instead

The model and batch are ``algorithms.py``'s (the 33.6 MB MLP, SGD with momentum). For this
run only, the package's steps are wrapped with timestamps (``time.perf_counter``, one clock
for every process of the machine): a bucket handed to the engine (its last gradient is
ready), the end of ``zero_grad()`` and of the forward pass, every engine cycle (each is one
round of the ranks' bitwise AND over the control plane), the start of the bucket's gloo
allreduce, its end (the callback of gloo's future, which fires in gloo's own thread as soon
as the transfer ends) and the completion of its handle (every completion is marked: the
bucket's are those after its end). Per timed step, each rank prints its events in ms from
rank 0's step start, then a summary: per bucket the delay from the later rank's submission
to its start on this rank, the delay from the last transfer's end to the next completion,
and the cycles the engine ran while the transfers were in flight. Each rank's CPU time per
timed step follows (from ``/proc``): its main thread, the engine thread, and every other
thread together (gloo's and MPI's).

With ``--ddp`` the same model runs under torch's ``DistributedDataParallel`` over gloo
instead, with a communication hook that does what DDP's default one does (divide the bucket
by the world size, allreduce it) and marks the same events: DDP launches a bucket's
allreduce as soon as its last gradient is ready, so "submit" and "start" coincide, and
"completed" is the hook's future resolving. No engine, so no cycles.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
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
    bitwise_and = loop.EngineLoop._bitwise_and

    def anded(self: Any, words: Any) -> Any:
        agreed = bitwise_and(self, words)
        _mark("and")
        return agreed

    loop.EngineLoop._bitwise_and = anded  # type: ignore[method-assign]


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


def _ddp_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default allreduce hook (divide, allreduce), marking this script's events. Not
    annotated: DDP rejects a hook whose annotations are not its own classes (and under
    ``from __future__ import annotations`` every annotation is a string)."""
    import torch.distributed as dist

    tensor = bucket.buffer().div_(dist.get_world_size())
    _mark("submit")
    _mark("start")
    future = dist.all_reduce(tensor, async_op=True).get_future()

    def done(fut: Any) -> Any:
        _mark("end")
        _mark("completed")
        return fut.value()[0]

    return future.then(done)


def _build(use_ddp: bool) -> tuple[Any, Any]:
    """The model and its optimizer: DistributedOptimizer's default path, or torch DDP."""
    model = algorithms.build_model()
    if use_ddp:
        from gloo import start_gloo
        from mpi4py import MPI

        start_gloo(MPI.COMM_WORLD)
        model = torch.nn.parallel.DistributedDataParallel(model)
        model.register_comm_hook(None, _ddp_hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    _instrument()
    hvd.init()
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, hvd.DistributedOptimizer(
        base, named_parameters=list(model.named_parameters()), algorithm=None
    )


def _cpu_by_thread() -> dict[int, float]:
    """CPU seconds used so far by each thread of this process (Linux; empty elsewhere)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        used = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            used[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
        return used
    except OSError:
        return {}


def _cpu_summary(before: dict[int, float], after: dict[int, float], steps: int) -> str:
    """CPU ms per step: the main thread, baguahvd's engine thread, the other threads
    together (gloo's and MPI's)."""
    named = {t.native_id: t.name for t in threading.enumerate()}
    parts = {"main": 0.0, "engine": 0.0, "others": 0.0}
    for tid, seconds in after.items():
        name = named.get(tid, "")
        key = ("main" if name == "MainThread" else "engine" if name == "baguahvd-engine"
               else "others")
        parts[key] += 1e3 * (seconds - before.get(tid, 0.0)) / steps
    return ", ".join(f"{key} {value:.1f}" for key, value in parts.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ddp", action="store_true",
                        help="torch DistributedDataParallel (gloo) instead of baguahvd")
    args = parser.parse_args()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    model, optimizer = _build(args.ddp)
    generator = torch.Generator().manual_seed(1 + rank)
    data = torch.randn(args.batch_size, algorithms.MODEL_DIMS[0], generator=generator)
    target = torch.randint(0, algorithms.MODEL_DIMS[-1], (args.batch_size,),
                           generator=generator)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps: list[float] = []
    cpu_before: dict[int, float] = {}
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            cpu_before = _cpu_by_thread()
        comm.Barrier()
        _events.clear()
        origin = comm.bcast(time.perf_counter(), 0)
        start = time.perf_counter()
        optimizer.zero_grad()
        _mark("zeroed")
        loss = loss_fn(model(data), target)
        _mark("forward done")
        loss.backward()
        _mark("backward done")
        optimizer.step()
        _mark("step done")
        steps.append(time.perf_counter() - start)
        events = list(_events)
        submits = [t for t, what in events if what == "submit"]
        everyone = comm.allgather(submits)
        if index < args.warmup:
            continue
        line = "; ".join(f"{1e3 * (t - origin):.1f} {what}" for t, what in events)
        theirs = [other for index, other in enumerate(everyone) if index != rank]
        print(f"rank {rank} step {index}: {line}\n  {_summary(events, theirs)}",
              flush=True)
    cpu = _cpu_summary(cpu_before, _cpu_by_thread(), args.steps)
    cpu_lines = comm.gather(cpu, 0)
    if rank == 0:
        print(f"median step {1e3 * statistics.median(steps[args.warmup:]):.1f} ms", flush=True)
        for index, line in enumerate(cpu_lines or ()):
            print(f"rank {index} CPU ms per timed step: {line}", flush=True)
    if not args.ddp:
        hvd.shutdown()


if __name__ == "__main__":
    main()
