"""Step time with autotune against hand-picked fusion thresholds, measured in one run.

Run under MPI with two ranks::

    mpirun -np 2 python benchmarks/autotune.py
    mpirun -np 2 python benchmarks/autotune.py --quick     # fewer steps, smaller samples

The script trains one MLP with Horovod's per-gradient ``DistributedOptimizer``. For each
hand-picked HOROVOD_FUSION_THRESHOLD it restarts baguahvd (``shutdown()`` then ``init()``
with the variable set), warms up, and times steps; then it restarts with HOROVOD_AUTOTUNE=1,
trains until the autotune has frozen, and times steps under the frozen settings. It prints
the median step time of each and the ratio of autotune's to the best hand-picked one.
Rank 0 reads the frozen settings; every rank times the same steps, and the slowest rank's
time counts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime

THRESHOLDS_MIB = (0, 1, 4, 16, 64, 128)


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _restart(env: dict[str, str]) -> None:
    hvd.shutdown()
    for name in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG",
                 "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"):
        os.environ.pop(name, None)
    os.environ.update(env)
    hvd.init()


def _steps(width: int, warmup: int, timed: int, until_frozen: bool) -> float:
    model = _model(width)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    x, y = torch.randn(32, width), torch.randint(0, 10, (32,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    engine = runtime.require_engine()
    for _ in range(warmup):
        step()
    while until_frozen and hvd.broadcast_object(engine.autotuning, 0, name="tuning"):
        for _ in range(10):
            step()
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return max(hvd.allgather_object(statistics.median(times)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (8 layers)")
    args = parser.parse_args()
    warmup, timed = (10, 30) if args.quick else (20, 100)
    hvd.init()
    results = {}
    for mib in THRESHOLDS_MIB:
        _restart({"HOROVOD_FUSION_THRESHOLD": str(mib * 1024 * 1024)})
        results[f"threshold {mib} MiB"] = _steps(args.width, warmup, timed, False)
    log = "/tmp/baguahvd_autotune_bench.csv"
    _restart({
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": log,
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "5" if args.quick else "10",
    })
    results["autotune"] = _steps(args.width, warmup, timed, True)
    settings = runtime.require_engine().settings
    if hvd.rank() == 0:
        params = sum(p.numel() for p in _model(args.width).parameters())
        print(f"{hvd.size()} ranks, {params * 4 / 2**20:.1f} MiB of gradients, "
              f"median step time (s), slowest rank:")
        for label, seconds in results.items():
            print(f"  {label:>22}: {seconds:.4f}")
        best = min(v for k, v in results.items() if k != "autotune")
        print(f"  autotune froze at fusion threshold {settings.fusion_threshold / 2**20:g} MiB, "
              f"cycle time {settings.cycle_time_ms:g} ms; autotune / best hand-picked = "
              f"{results['autotune'] / best:.3f} (log: {log})")
    hvd.shutdown()


if __name__ == "__main__":
    main()
