"""DistributedOptimizer's training step with gradient buckets against its per-tensor path.

Run under MPI with two ranks on one machine::

    mpirun -np 2 python benchmarks/gradient_buckets.py
    mpirun -np 2 python benchmarks/gradient_buckets.py --counts 50 500 --each 4K --repeats 9

For each gradient count, two identical models of that many parameters (``--each`` bytes of
float32 each; the forward pass is one multiply-add per parameter, so the step is dominated
by what the gradients cost) are trained with ``DistributedOptimizer`` in the same run: one
with buckets (``BAGUAHVD_GRADIENT_BUCKETS=1``, the default) and one with every gradient
reduced as its own request, as Horovod does (``BAGUAHVD_GRADIENT_BUCKETS=0``; the switch is
flipped in-process between building the two optimizers). A step is ``zero_grad``, forward,
backward and ``step``. Every repetition times ``--iters`` steps of each variant, alternating,
each after a barrier; a variant's time is the slowest rank's seconds per step, and the table
shows the median over repetitions, the ratio per-tensor / buckets (above 1: buckets are
faster) and the bytes each path copied through the engine's fusion buffers per step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Iterator

import torch
from mpi4py import MPI
from torch import nn

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    if text[-1].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


class Many(nn.Module):
    """``count`` parameters of ``numel`` elements; the loss touches each once."""

    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([(w * x).sum() for w in self.weights]).sum()


@contextlib.contextmanager
def buckets(enabled: bool) -> Iterator[None]:
    """Optimizers built inside use buckets or not, whatever the environment said at init."""
    config = runtime.config
    assert config is not None
    runtime.config = dataclasses.replace(config, gradient_buckets=enabled)
    try:
        yield
    finally:
        runtime.config = config


class Variant:
    def __init__(self, count: int, numel: int, bucketed: bool) -> None:
        self.model = Many(count, numel)
        with buckets(bucketed):
            self.optimizer = hvd.DistributedOptimizer(
                torch.optim.SGD(self.model.parameters(), lr=1e-3),
                named_parameters=self.model.named_parameters(),
            )
        self.x = torch.randn(numel, generator=torch.Generator().manual_seed(hvd.rank()))
        self.copied = 0
        self.steps = 0

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.model(self.x).backward()
        self.optimizer.step()

    def timed(self, iters: int, comm: MPI.Comm) -> float:
        engine = runtime.require_engine()
        comm.Barrier()
        before = engine.fusion_bytes
        start = time.perf_counter()
        for _ in range(iters):
            self.step()
        elapsed = (time.perf_counter() - start) / iters
        self.copied += engine.fusion_bytes - before
        self.steps += iters
        return float(comm.allreduce(elapsed, op=MPI.MAX))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[50, 100, 200, 500])
    parser.add_argument("--each", default="1K", help="bytes per gradient (float32)")
    parser.add_argument("--iters", type=int, default=20, help="steps per timed sample")
    parser.add_argument("--repeats", type=int, default=7, help="samples per variant")
    args = parser.parse_args()
    hvd.init()
    comm = MPI.COMM_WORLD
    numel = max(1, _size(args.each) // 4)
    rank0 = hvd.rank() == 0
    if rank0:
        print(f"{hvd.size()} ranks, {numel * 4} bytes per gradient, {args.iters} steps per "
              f"sample, median of {args.repeats}; load average {os.getloadavg()[0]:.2f}")
        print(f"{'gradients':>9} {'buckets ms':>11} {'per-tensor ms':>14} {'ratio':>6} "
              f"{'fusion B/step buckets':>22} {'per-tensor':>11}")
    for count in args.counts:
        variants = [Variant(count, numel, True), Variant(count, numel, False)]
        for variant in variants:  # the first step records the order and builds buckets
            for _ in range(3):
                variant.step()
            variant.copied = variant.steps = 0
        samples: list[list[float]] = [[], []]
        for _ in range(args.repeats):
            for index, variant in enumerate(variants):
                samples[index].append(variant.timed(args.iters, comm))
        bucketed, per_tensor = (statistics.median(s) for s in samples)
        if rank0:
            copied = [v.copied // max(1, v.steps) for v in variants]
            print(f"{count:>9} {bucketed * 1e3:>11.3f} {per_tensor * 1e3:>14.3f} "
                  f"{per_tensor / bucketed:>6.2f} {copied[0]:>22} {copied[1]:>11}")
    if rank0:
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
