"""Part 8 of ``benchmarks/gpu_check.py``: how much of a training step's communication the
backward pass hides.

Three timings of the same model and batch, interleaved in rounds (each round starting with
another one) so that a slow spell of the machine hits all three alike:

* ``compute``: forward, backward and ``step()`` of a plain torch optimizer (no baguahvd);
* ``step``: the same with ``hvd.DistributedOptimizer`` (communication starts from the
  backward hooks and ``step()`` waits for it);
* ``communication``: the gradients' allreduces alone (``allreduce_async_`` of tensors shaped
  like the gradients, then ``synchronize``), without a backward pass.

``hidden = (compute + communication - step) / communication``, clipped to [0, 1]: 1 when
the step costs no more than its compute, 0 when it costs the sum of both. Each step is timed
on the host (from before the forward pass to after a device synchronize) and with CUDA
events on the default stream; the figures are medians.

Run under ``torchrun --standalone --nproc_per_node=1`` with BAGUAHVD_NCCL_SINGLE_RANK=1, so
the gradients go through a one-rank NCCL communicator.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
from gpu_check_common import Recorder, WorkerArgs, compare, require, run_worker

import baguahvd.torch as hvd

LAYERS, WIDTH, BATCH = 8, 2048, 1024
"""An MLP of 8 x 2048 x 2048 fp32 (134 MB of gradients in 16 tensors) on a batch of 1024."""
WARMUP, ROUNDS, STEPS = 3, 3, 5


class StepTimer:
    """Host and CUDA-event times of single calls of one function."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host_s: list[float] = []
        self.event_s: list[float] = []

    def run(self, fn: Callable[[], None], record: bool = True) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        fn()
        if cuda:
            end.record()
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - began
        if record:
            self.host_s.append(took)
            if cuda:
                self.event_s.append(start.elapsed_time(end) / 1e3)

    def host_ms(self) -> float:
        """The median host time of a call, in milliseconds."""
        return statistics.median(self.host_s) * 1e3

    def event_ms(self) -> float | None:
        """The median CUDA-event time of a call, in milliseconds (None on the CPU)."""
        return statistics.median(self.event_s) * 1e3 if self.event_s else None


def overlap(rec: Recorder, args: WorkerArgs) -> None:
    device = args.device
    width, batch = (WIDTH, BATCH) if device.type == "cuda" else (256, 64)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    plain_model = torch.nn.Sequential(*layers).to(device)
    dist_model = copy.deepcopy(plain_model)
    inputs = torch.randn(batch, width, device=device)
    targets = torch.randn(batch, width, device=device)
    plain = torch.optim.SGD(plain_model.parameters(), lr=1e-3)
    dist = hvd.DistributedOptimizer(torch.optim.SGD(dist_model.parameters(), lr=1e-3),
                                    named_parameters=dist_model.named_parameters())
    buffers = [torch.randn_like(p) for p in plain_model.parameters()]
    gradient_bytes = sum(b.numel() * b.element_size() for b in buffers)
    rec.data["model"] = {"layers": LAYERS, "width": width, "batch": batch,
                         "gradients": len(buffers), "gradient_mb": round(gradient_bytes / 1e6, 1)}

    def step_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
        return step

    def communicate() -> None:
        handles = [hvd.allreduce_async_(b, name=f"overlap.communication.{i}")
                   for i, b in enumerate(buffers)]
        for handle in handles:
            hvd.synchronize(handle)

    runs = {
        "compute": step_of(plain_model, plain),
        "step": step_of(dist_model, dist),
        "communication": communicate,
    }
    timers = {name: StepTimer(device) for name in runs}

    def measure() -> str:
        for name, fn in runs.items():
            for _ in range(WARMUP):
                timers[name].run(fn, record=False)
        names = list(runs)
        for round_ in range(ROUNDS):
            # Each round starts with another of the three, so none always runs first.
            for name in names[round_ % 3:] + names[:round_ % 3]:
                for _ in range(STEPS):
                    timers[name].run(runs[name])
        rec.data["median_ms"] = {
            name: {"host": round(timer.host_ms(), 4), "cuda_events": timer.event_ms()}
            for name, timer in timers.items()
        }
        compute, step, communication = (timers[name].host_ms() for name in runs)
        require(min(compute, step, communication) > 0, f"times {rec.data['median_ms']}")
        hidden = (compute + communication - step) / communication
        rec.data["hidden_fraction"] = round(min(max(hidden, 0.0), 1.0), 3)
        rec.data["hidden_fraction_unclipped"] = round(hidden, 3)
        rec.data["step_over_compute"] = round(step / compute, 3)
        return (f"compute {compute:.3f} ms, step {step:.3f} ms, communication alone "
                f"{communication:.3f} ms: {rec.data['hidden_fraction']:.0%} hidden")

    if not rec.check("measure", measure):
        return

    def same_training() -> str:
        # Both models took the same steps on the same batch; averaging over one rank
        # changes nothing, so they must agree.
        details = [compare(d, p.detach().cpu(), tol=1e-5)
                   for d, p in zip(dist_model.parameters(), plain_model.parameters())]
        return f"{len(details)} parameters match the plain optimizer's ({details[0]})"

    rec.check("parameters_match_plain_training", same_training)


if __name__ == "__main__":
    sys.exit(run_worker({"overlap": overlap}, engine=True))
