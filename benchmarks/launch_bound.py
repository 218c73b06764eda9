"""A launch-bound training step: the main thread issues tiny ops while gradients are reduced.

The model is a chain of ``--grads`` small parameter tensors (``h = tanh(h * p)`` per
parameter, ``KIB`` KiB each): its forward and backward are hundreds of tiny kernels issued
from Python, and each gradient becomes ready on its own, as in a model with many small
layers. Each system trains the same model with SGD, in one run, every round alternating
the order of the systems:

- ``local``: no communication (what the step costs on its own);
- ``baguahvd``: ``hvd.DistributedOptimizer`` (the default path); ``baguahvd@VAR=VALUE``
  restarts baguahvd with an environment setting first (e.g. a path switched off);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo,
  ``gradient_as_bucket_view=True``;
- ``horovod``: Horovod's ``DistributedOptimizer``, added when ``horovod.torch`` imports.

Reported per system and shape: the step time (median over the timed steps and rounds, the
slowest rank's), and for baguahvd the CPU time of its engine thread as a share of the step.
The engine thread holds the GIL for its Python work and releases it inside MPI calls, so
that share is an upper bound on the GIL the training thread loses to it.

    mpirun -np 2 python benchmarks/launch_bound.py --grads 50 200 500 --kib 1 16 256
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo import start_gloo  # noqa: E402

import baguahvd.torch as hvd  # noqa: E402

try:
    import horovod.torch as real_horovod  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure means "not available"
    real_horovod = None

BATCH = 4
"""Rows of the input: the chain's activations are BATCH x (KIB * 256) floats."""


class Chain(torch.nn.Module):
    """``count`` parameters of ``width`` floats, applied one after the other."""

    def __init__(self, count: int, width: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(1 + 0.01 * torch.randn(width, generator=generator))
            for _ in range(count)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.weights:
            x = torch.tanh(x * weight)
        return x


def _thread_cpu_s(thread: threading.Thread | None) -> float:
    if thread is None or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError):
        return 0.0


def _engine_thread() -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == "baguahvd-engine"), None)


def _set_up(system: str, comm: Any) -> None:
    """Starts the system's communication (collective)."""
    if system.startswith("baguahvd"):
        setting = system.partition("@")[2]
        wanted = dict([setting.split("=", 1)]) if setting else {}
        current = getattr(_set_up, "settings", None)
        if hvd.is_initialized() and current == wanted:
            return
        if hvd.is_initialized():
            hvd.shutdown()
        for name in set(current or {}) - set(wanted):
            os.environ.pop(name, None)
        os.environ.update(wanted)
        _set_up.settings = wanted  # type: ignore[attr-defined]
        hvd.init()
    elif system == "horovod":
        real_horovod.init()


def run(system: str, count: int, kib: int, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """This rank's timed steps of ``system`` on a chain of ``count`` x ``kib`` KiB."""
    width = kib * 256
    model: torch.nn.Module = Chain(count, width)
    named = list(model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=1e-3)
    optimizer: Any = base
    if system == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    elif system.startswith("baguahvd"):
        optimizer = hvd.DistributedOptimizer(base, named_parameters=named)
    elif system == "horovod":
        optimizer = real_horovod.DistributedOptimizer(base, named_parameters=named)
    data = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        model(data).sum().backward()
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    engine = _engine_thread() if system.startswith("baguahvd") else None
    cpu0, wall0 = _thread_cpu_s(engine), time.perf_counter()
    times = [step() for _ in range(args.steps)]
    wall = time.perf_counter() - wall0
    engine_share = (_thread_cpu_s(engine) - cpu0) / wall if engine is not None else None
    return {"times": times, "engine_share": engine_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grads", type=int, nargs="+", default=[50, 200, 500])
    parser.add_argument("--kib", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--systems", nargs="+", default=["local", "baguahvd", "ddp"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"),
                        help="only draw the step times of an earlier run's JSON")
    args = parser.parse_args()
    if args.plot:
        plot(*args.plot)
        return
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    systems = list(args.systems)
    if real_horovod is not None and "horovod" not in systems:
        systems.append("horovod")
    if "ddp" in systems:
        start_gloo(comm)
    torch.set_num_threads(1)
    results = []
    for count in args.grads:
        for kib in args.kib:
            per_system: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
            for round_index in range(args.repeats):
                for system in systems if round_index % 2 == 0 else systems[::-1]:
                    _set_up(system, comm)
                    comm.Barrier()
                    mine = run(system, count, kib, args, rank)
                    if system == "horovod":
                        real_horovod.shutdown()
                    gc.collect()
                    everyone = comm.gather(mine, root=0)
                    if rank == 0:
                        per_system[system].extend(everyone or [])
            if rank != 0:
                continue
            row: dict[str, Any] = {"grads": count, "kib": kib, "systems": {}}
            for system, ranks in per_system.items():
                step_s = max(statistics.median(r["times"]) for r in ranks)
                shares = [r["engine_share"] for r in ranks if r["engine_share"] is not None]
                row["systems"][system] = {
                    "step_ms": 1e3 * step_s,
                    "engine_cpu_share": statistics.median(shares) if shares else None,
                }
            results.append(row)
            print(_line(row), flush=True)
    if hvd.is_initialized():
        hvd.shutdown()
    if rank == 0 and args.json:
        with open(args.json, "w") as out:
            json.dump({"ranks": comm.Get_size(), "warmup": args.warmup, "steps": args.steps,
                       "repeats": args.repeats, "rows": results}, out, indent=1)


def plot(source: str, target: str) -> None:
    """Step time over local step time against the number of gradients, one panel per
    gradient size, one line per system (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(source) as handle:
        rows = json.load(handle)["rows"]
    sizes = sorted({row["kib"] for row in rows})
    figure, axes = plt.subplots(1, len(sizes), figsize=(4 * len(sizes), 3.4), sharey=True)
    for axis, kib in zip(axes if len(sizes) > 1 else [axes], sizes):
        chosen = sorted((r for r in rows if r["kib"] == kib), key=lambda r: r["grads"])
        for system in chosen[0]["systems"]:
            if system == "local":
                continue
            ratios = [r["systems"][system]["step_ms"] / r["systems"]["local"]["step_ms"]
                      for r in chosen]
            label = system.replace("@BAGUAHVD_GRADIENT_BUCKETS=0", " (per gradient)")
            axis.plot([r["grads"] for r in chosen], ratios, marker="o", label=label)
        axis.set_title(f"{kib} KiB gradients")
        axis.set_xlabel("gradients")
        axis.set_xscale("log")
        axis.minorticks_off()
        axis.set_xticks([r["grads"] for r in chosen], [str(r["grads"]) for r in chosen])
        axis.grid(alpha=0.3)
    (axes[0] if len(sizes) > 1 else axes).set_ylabel("step time / step without communication")
    (axes[-1] if len(sizes) > 1 else axes).legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(target, dpi=110)


def _line(row: dict[str, Any]) -> str:
    systems = row["systems"]
    local = systems.get("local", {}).get("step_ms")
    parts = [f"{row['grads']:4d} x {row['kib']:3d} KiB"]
    for name, figures in systems.items():
        text = f"{name} {figures['step_ms']:7.2f} ms"
        if local and name != "local":
            text += f" ({figures['step_ms'] / local:4.2f}x local)"
        if figures["engine_cpu_share"] is not None:
            text += f" engine CPU {100 * figures['engine_cpu_share']:3.0f}%"
        parts.append(text)
    return " | ".join(parts)


if __name__ == "__main__":
    main()
