"""What BAGUAHVD_CHECK_CALL_SITES costs per unnamed collective.

Run it twice, without and with the variable, and compare the per-call times::

    mpirun -np 2 python benchmarks/call_sites.py
    mpirun -np 2 -x BAGUAHVD_CHECK_CALL_SITES=1 python benchmarks/call_sites.py

Each run times ``--calls`` unnamed ``hvd.allreduce`` calls of a one-element float32 tensor
(median of ``--repeats`` rounds, the slowest rank's view) and, on its own, the site capture
(:func:`baguahvd.engine.submission.call_site`) as it runs for such a call: from under
``hvd.allreduce``, its autograd function and the submission path.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from unittest import mock

import torch

import baguahvd.torch as hvd
from baguahvd.engine import submission


def _per_call_us(calls: int, repeats: int) -> float:
    tensor = torch.ones(1)
    samples = []
    for _ in range(repeats):
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            hvd.allreduce(tensor, op=hvd.Sum)
        elapsed = time.perf_counter() - start
        slowest = hvd.allreduce(torch.tensor([elapsed]), op=hvd.Max, name="bench.slowest")
        samples.append(slowest.item() / calls * 1e6)
    return statistics.median(samples)


def _capture_us(calls: int) -> float:
    """Time of call_site() alone, captured from inside a real submission: the frames it
    walks are those of an hvd.allreduce call."""
    durations: list[float] = []
    original = submission.call_site

    def timed() -> str:
        start = time.perf_counter()
        site = original()
        durations.append(time.perf_counter() - start)
        return site

    tensor = torch.ones(1)
    with mock.patch.object(submission, "call_site", timed):
        for _ in range(calls):
            hvd.allreduce(tensor, op=hvd.Sum)
    return statistics.median(durations) * 1e6 if durations else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    _per_call_us(1000, 1)  # warm-up
    per_call = _per_call_us(args.calls, args.repeats)
    capture = _capture_us(2000)
    if hvd.rank() == 0:
        checking = "off" if math.isnan(capture) else "on"
        print(f"ranks: {hvd.size()}  BAGUAHVD_CHECK_CALL_SITES: {checking}")
        print(f"unnamed allreduce of 1 float32: {per_call:.1f} us per call "
              f"(median of {args.repeats} x {args.calls})")
        if checking == "on":
            print(f"site capture alone: {capture:.2f} us per call (median of 2000)")


if __name__ == "__main__":
    main()
