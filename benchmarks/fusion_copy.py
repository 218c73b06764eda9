"""The copies of a fused CPU allreduce: its tensors into the fusion buffer and back out,
each way by the calls torch offers, on one thread of one process.

    python benchmarks/fusion_copy.py [--layouts 300x4K 256x16K 64x256K] [--repeats 201]

Copy-in: ``torch._foreach_copy_(views, tensors)`` (one call for any shapes),
``torch.cat(tensors, out=buffer)`` (one call, flat tensors only) and a ``copy_`` per tensor.
Copy-out: ``torch._foreach_copy_(tensors, views)``, ``torch.split_with_sizes_copy(buffer,
sizes, out=tensors)`` and a ``copy_`` per tensor. Each way also by the extension built
from ``csrc/host_copy.c`` (``baguahvd.kernels.host_copy``), where it is built: what the
engine uses then. Each is timed warm (the same copy again
at once) and cold (after writing 64 MB elsewhere, as the engine finds the users' tensors
after a backward pass). Medians in microseconds; every repetition runs every variant once,
in the same order.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from baguahvd.kernels import host_copy

_UNITS = {"K": 1 << 10, "M": 1 << 20}


def _layout(text: str) -> tuple[int, int]:
    """``COUNTxBYTES`` (e.g. ``300x4K``): the tensors and the float32 bytes of each."""
    count, size = text.lower().split("x")
    unit = _UNITS.get(size[-1].upper(), 1)
    return int(count), int(size.rstrip("kKmM")) * unit


def _variants(count: int, each: int) -> dict[str, Callable[[], object]]:
    tensors = [torch.randn(each // 4) for _ in range(count)]
    buffer = torch.empty(count * (each // 4))
    sizes = [each // 4] * count
    views = list(buffer.split(sizes))
    variants: dict[str, Callable[[], object]] = {
        "in: _foreach_copy_": lambda: torch._foreach_copy_(views, tensors),
        "in: cat(out=buffer)": lambda: torch.cat(tensors, out=buffer),
        "in: copy_ per tensor": lambda: [v.copy_(t) for v, t in zip(views, tensors)],
        "out: _foreach_copy_": lambda: torch._foreach_copy_(tensors, views),
        "out: split_with_sizes_copy": lambda: torch.split_with_sizes_copy(
            buffer, sizes, out=tensors),
        "out: copy_ per tensor": lambda: [t.copy_(v) for v, t in zip(views, tensors)],
    }
    if host_copy.native():
        variants["in: host_copy extension"] = lambda: host_copy.gather(
            tensors, buffer, views, flat=False)
        variants["out: host_copy extension"] = lambda: host_copy.scatter(buffer, views, tensors)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["300x4K", "256x16K", "64x256K"])
    parser.add_argument("--repeats", type=int, default=201)
    args = parser.parse_args()
    torch.set_num_threads(1)
    evict = torch.empty(16 << 20)
    print(f"torch {torch.__version__}, one thread; median microseconds of {args.repeats}")
    for text in args.layouts:
        count, each = _layout(text)
        variants = _variants(count, each)
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for name, call in variants.items():
                for state in ("cold", "warm"):
                    if state == "cold":
                        evict.fill_(1.0)
                    start = time.perf_counter()
                    call()
                    samples.setdefault((name, state), []).append(time.perf_counter() - start)
        print(f"{count} x {each} B ({count * each / 1e6:.1f} MB)        cold       warm")
        for name in variants:
            cold = 1e6 * statistics.median(samples[(name, "cold")])
            warm = 1e6 * statistics.median(samples[(name, "warm")])
            print(f"  {name:<28} {cold:9.1f}  {warm:9.1f}")


if __name__ == "__main__":
    main()
