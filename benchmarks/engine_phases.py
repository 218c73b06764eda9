"""Where the engine thread's time goes in a burst of small in-place allreduces.

    mpirun -np 2 python benchmarks/engine_phases.py              # 300 named x 4 KB
    mpirun -np 2 python benchmarks/engine_phases.py --unnamed --count 300 --bursts 200
    mpirun -np 2 python benchmarks/engine_phases.py --grouped --count 256 --bytes 16384

Each burst submits ``--count`` in-place ``allreduce_async_`` of ``--bytes`` (float32), then
synchronizes every handle in order, after a small blocking allreduce that lines the ranks up.
Timers wrapped around the engine's steps (for this run only: the package's classes are
patched in the ranks' processes) add up each step's seconds per burst; every rank prints
the median over bursts of each step, and of three spans seen by the caller: the
submissions, the wait for the first handle (the engine's work after the last submission)
and the wait for the others. With ``--grouped`` a burst is one out-of-place
``grouped_allreduce`` of the ``--count`` tensors, and the caller sees one span: the call.

The steps, in the order a cycle runs them: ``let_burst_finish`` (waiting for the
submissions to stop), ``take`` (the queue), ``admit_all``, ``announcement``,
``bitwise_and`` (the cycle's one wait for the other ranks), ``cached_work``,
``file_responses``, ``plan`` (the fusion plan), and ``run_unit``, within which ``execute``
(``copy_in``: the ``torch.cat`` into the fusion buffer, ``reduce``: the MPI allreduce,
``copy_out``) and ``deliver`` (completing the handles). Each timer costs about a
microsecond, so steps called once per cycle are measured closely and none is called per
request.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import baguahvd.torch as hvd
from baguahvd.backends.mpi import communicator
from baguahvd.engine import intake, loop
from baguahvd.engine.execution import completion, dispatch, execute, fusion
from baguahvd.engine.negotiation import negotiator
from baguahvd.kernels import host_copy

_spent: collections.Counter[str] = collections.Counter()


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[label] += time.perf_counter() - start

    return timed


def _instrument() -> list[str]:
    """Wraps the engine's steps in timers; returns their labels in cycle order."""
    steps = [
        ("let_burst_finish", intake.RequestQueue, "let_burst_finish"),
        ("take", intake.RequestQueue, "take"),
        ("admit_all", negotiator.Negotiator, "admit_all"),
        ("announcement", negotiator.Negotiator, "announcement"),
        ("bitwise_and", loop.EngineLoop, "_bitwise_and"),
        ("cached_work", negotiator.Negotiator, "cached_work"),
        ("file_responses", negotiator.Negotiator, "file_responses"),
        ("run_unit", dispatch.Dispatcher, "run_unit"),
        ("execute", dispatch.Dispatcher, "execute"),
        ("reduce", communicator.MPICommunicator, "_allreduce"),
        ("release_retries", intake.RequestQueue, "release_retries"),
    ]
    for label, owner, name in steps:
        setattr(owner, name, _timed(label, getattr(owner, name)))
    execute._copy_out = _timed("copy_out", execute._copy_out)
    completion.deliver = _timed("deliver", completion.deliver)
    plan = fusion.FusionPlans.plan

    def planned(self: fusion.FusionPlans, *args: Any, **kwargs: Any) -> list[Any]:
        start = time.perf_counter()
        units = list(plan(self, *args, **kwargs))  # a generator: timed to its end
        _spent["plan"] += time.perf_counter() - start
        return units

    fusion.FusionPlans.plan = planned  # type: ignore[method-assign]
    cat = torch.cat

    def copied_in(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return cat(*args, **kwargs)
        finally:
            if "out" in kwargs:  # the fusion buffer's copy-in, not the caller's tensors
                _spent["copy_in"] += time.perf_counter() - start

    execute.torch.cat = copied_in  # type: ignore[assignment]
    return [label for label, _, _ in steps[:7]] + [
        "plan", "run_unit", "execute", "copy_in", "reduce", "copy_out", "deliver",
        "release_retries",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="allreduces per burst")
    parser.add_argument("--bytes", type=int, default=4096, help="float32 bytes per tensor")
    parser.add_argument("--bursts", type=int, default=100, help="timed bursts")
    parser.add_argument("--warmup", type=int, default=10, help="untimed bursts")
    parser.add_argument("--unnamed", action="store_true", help="submit without names")
    parser.add_argument("--grouped", action="store_true",
                        help="one grouped_allreduce of the tensors per burst")
    parser.add_argument("--torch-copies", action="store_true",
                        help="copy out of the fusion buffer with torch even where the host "
                        "copy extension is built")
    args = parser.parse_args()
    if args.torch_copies:
        host_copy._native = None
    labels = _instrument()
    hvd.init()
    tensors = [torch.ones(args.bytes // 4) for _ in range(args.count)]
    names = [None if args.unnamed else f"burst.{index}" for index in range(args.count)]
    spans: list[tuple[float, float, float]] = []
    steps: list[dict[str, float]] = []
    for burst in range(args.warmup + args.bursts):
        hvd.allreduce(torch.zeros(1), name="engine_phases.line_up")
        _spent.clear()
        start = time.perf_counter()
        if args.grouped:
            hvd.grouped_allreduce(tensors, op=hvd.Sum, name=names[0])
            if burst >= args.warmup:
                spans.append((time.perf_counter() - start, 0.0, 0.0))
                steps.append(dict(_spent))
            continue
        handles = [hvd.allreduce_async_(t, name=n) for t, n in zip(tensors, names)]
        submitted = time.perf_counter()
        hvd.synchronize(handles[0])
        first = time.perf_counter()
        for handle in handles[1:]:
            hvd.synchronize(handle)
        if burst >= args.warmup:
            spans.append((submitted - start, first - submitted, time.perf_counter() - first))
            steps.append(dict(_spent))
    kind = ("unnamed" if args.unnamed else "named") + (" grouped" if args.grouped else "")
    copies = "extension" if host_copy.native() else "torch"
    lines = [f"rank {hvd.rank()}: {args.count} {kind} x {args.bytes} B, copies by {copies}, "
             f"median of {args.bursts} bursts, ms"]
    for index, span in enumerate(
        ["call"] if args.grouped else ["submissions", "first handle", "other handles"]
    ):
        lines.append(f"  {span:<18} {1e3 * statistics.median(s[index] for s in spans):7.3f}")
    for label in labels:
        median = statistics.median(step.get(label, 0.0) for step in steps)
        lines.append(f"  {label:<18} {1e3 * median:7.3f}")
    time.sleep(0.2 * hvd.rank())  # one rank's block after the other's
    print("\n".join(lines), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
