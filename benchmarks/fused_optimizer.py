"""Step time of ``fuse_optimizer`` against torch's per-tensor, foreach and fused optimizers.

    python benchmarks/fused_optimizer.py               # 200 x 1024 floats and 200 mixed sizes
    python benchmarks/fused_optimizer.py --threads 2   # torch CPU threads (default 1)

Only ``optimizer.step()`` is timed; gradients are set before each step, outside the timer.
Rows, per optimizer and parameter set:

- ``unfused``: the optimizer with ``foreach=False`` (one set of operations per parameter),
  the baseline of every ratio;
- ``foreach`` / ``fused``: torch's multi-tensor and fused implementations, where torch
  supports them on this device (``-`` otherwise);
- ``fuse_optimizer``: ``fuse_optimizer(opt)`` with gradients left in its buffer, as after
  ``zero_grad(set_to_none=False)``;
- ``fuse_optimizer+copy``: the same with fresh gradient tensors every step, as after
  ``zero_grad(set_to_none=True)``: the step first copies them into the buffer;
- ``fuse_optimizer(fused)``: ``fuse_optimizer`` over torch's ``fused=True`` optimizer, so
  each flat buffer is updated by torch's fused kernel (gradients in the buffer).

Each candidate runs ``--iters`` steps per round after a warm-up, in ``--rounds`` interleaved
rounds; the table shows the median time per step, and each ratio is unfused time over the
candidate's time (above 1 = faster than unfused). All from one run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from baguahvd.contrib import fuse_optimizer

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "SGD(momentum)": lambda p, **k: torch.optim.SGD(p, lr=0.01, momentum=0.9, **k),
    "Adam": lambda p, **k: torch.optim.Adam(p, lr=1e-3, **k),
    "AdamW": lambda p, **k: torch.optim.AdamW(p, lr=1e-3, **k),
    "RMSprop": lambda p, **k: torch.optim.RMSprop(p, lr=1e-3, **k),
    "Adagrad": lambda p, **k: torch.optim.Adagrad(p, lr=1e-2, **k),
}


def shapes(kind: str) -> list[int]:
    if kind == "200x1024":
        return [1024] * 200
    # 200 sizes spread log-uniformly over 16 .. 65536 elements, fixed by the seed.
    g = torch.Generator().manual_seed(0)
    logs = torch.rand(200, generator=g) * (math.log(65536) - math.log(16)) + math.log(16)
    return [int(math.exp(v)) for v in logs.tolist()]


def make(sizes: list[int], name: str, fuse: bool, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    optimizer = OPTIMIZERS[name](params, **kwargs)
    if fuse:
        optimizer = fuse_optimizer(optimizer)
    grads = [torch.randn(n) * 1e-2 for n in sizes]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()  # creates the state; the fused optimizer flattens it at the next step
    return optimizer, params, grads


def time_steps(setup: Any, iters: int, fresh: bool) -> float:
    optimizer, params, grads = setup
    total = 0.0
    for _ in range(iters):
        if fresh:
            for p, g in zip(params, grads):
                p.grad = g.clone()
        start = time.perf_counter()
        optimizer.step()
        total += time.perf_counter() - start
    return total / iters


def candidates(sizes: list[int], name: str) -> dict[str, tuple[Any, bool] | None]:
    rows: dict[str, tuple[Any, bool] | None] = {
        "unfused": (make(sizes, name, False, foreach=False), False)
    }
    for option in ("foreach", "fused"):
        try:
            rows[option] = (make(sizes, name, False, **{option: True}), False)
        except (RuntimeError, TypeError, ValueError):
            rows[option] = None
    rows["fuse_optimizer"] = (make(sizes, name, True, foreach=False), False)
    rows["fuse_optimizer+copy"] = (make(sizes, name, True, foreach=False), True)
    try:
        rows["fuse_optimizer(fused)"] = (make(sizes, name, True, fused=True), False)
    except (RuntimeError, TypeError, ValueError):
        rows["fuse_optimizer(fused)"] = None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    columns = ["foreach", "fused", "fuse_optimizer", "fuse_optimizer+copy", "fuse_optimizer(fused)"]
    print(f"torch {torch.__version__}, {args.threads} thread(s); unfused ms/step, then "
          "speed-up over unfused (unfused time / candidate time)")
    print(f"| parameters | optimizer | unfused ms | {' | '.join(columns)} |")
    print("|---|---|---:|" + "---:|" * len(columns))
    for kind in ("200x1024", "200 mixed"):
        sizes = shapes(kind)
        for name in OPTIMIZERS:
            rows = candidates(sizes, name)
            samples: dict[str, list[float]] = {key: [] for key, v in rows.items() if v}
            for _ in range(args.rounds):
                for key, value in rows.items():
                    if value is not None:
                        samples[key].append(time_steps(value[0], args.iters, value[1]))
            median = {key: statistics.median(v) for key, v in samples.items()}
            base = median["unfused"]
            cells = [f"{base / median[c]:.2f}x" if c in median else "-" for c in columns]
            label = f"{kind} ({sum(sizes)} floats)"
            print(f"| {label} | {name} | {base * 1e3:.2f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
