"""MinMaxUInt8 compress / decompress throughput against a plain copy, measured in one run.

    python benchmarks/kernels.py             # 1 MB, 16 MB, 64 MB of float32
    python benchmarks/kernels.py --quick     # 1 MB and 16 MB
    python benchmarks/kernels.py --threads 1 # one CPU thread (steadier on a busy machine)

Throughput is uncompressed bytes per second (the float32 tensor's size over the time of one
call). The copy row is ``dst.copy_(src)`` of the same float32 tensor, timed interleaved with
the kernels, and "vs copy" is kernel GB/s over copy GB/s (1.0 = as fast as a copy). On the
CPU the kernels are the torch fallback; with a GPU and CuPy the CUDA kernels are measured as
well, beside the torch fallback running on the GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch

import baguahvd.kernels as K
from baguahvd.kernels import torch_impl

MB = 2**20


def _time_per_call(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: allocations, lazy compilation
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


Candidates = dict[tuple[str, str], Callable[[], object]]


def _measure(
    candidates: Candidates, iters: int, sync: Callable[[], None], reps: int
) -> dict[tuple[str, str], float]:
    """Median seconds per call of each candidate, repetitions interleaved."""
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in candidates}
    for _ in range(reps):
        for key, fn in candidates.items():
            samples[key].append(_time_per_call(fn, iters, sync))
    return {key: statistics.median(values) for key, values in samples.items()}


def _candidates(x: torch.Tensor, n_chunks: int, impls: list[str]) -> Candidates:
    """Copy, then compress / decompress / decompress_reduce of ``x`` per implementation."""
    numel = x.numel()
    dst = torch.empty_like(x)
    layout = K.minmax_uint8_layout(numel, n_chunks)
    buf = K.compress_minmax_uint8(x, n_chunks)
    reduced = torch.empty(layout.chunk_size, device=x.device)
    out: Candidates = {("copy", "torch"): lambda: dst.copy_(x)}
    for impl in impls:
        if impl == "cuda":  # the public entry points dispatch CUDA tensors to the kernels
            out[("compress", impl)] = lambda: K.compress_minmax_uint8(x, n_chunks, out=buf)
            out[("decompress", impl)] = lambda: K.decompress_minmax_uint8(
                buf, n_chunks, numel, out=dst
            )
            out[("decompress_reduce", impl)] = lambda: K.decompress_reduce_minmax_uint8(
                buf, n_chunks, numel, out=reduced
            )
        else:
            out[("compress", impl)] = lambda: torch_impl.compress(x, layout, buf)
            out[("decompress", impl)] = lambda: torch_impl.decompress(buf, layout, dst)
            out[("decompress_reduce", impl)] = lambda: torch_impl.decompress_reduce(
                buf, layout, reduced
            )
    return out


def _run_device(device: torch.device, sizes_mb: list[int], n_chunks: int, reps: int) -> None:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    impls = ["torch"]
    if cuda and K.cuda_kernels_available():
        impls.insert(0, "cuda")
    print(f"\n{device.type.upper()}  (n_chunks={n_chunks}, float32, median of {reps})")
    header = f"{'size':>7}  {'op':<20}{'impl':<7}{'GB/s':>9}{'vs copy':>9}"
    print(header)
    print("-" * len(header))
    for size_mb in sizes_mb:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(size_mb * MB // 4, generator=gen).to(device)
        iters = max(2, min(200, (256 if cuda else 48) // size_mb))
        seconds = _measure(_candidates(x, n_chunks, impls), iters, sync, reps)
        nbytes = x.numel() * 4
        copy_gbs = nbytes / seconds[("copy", "torch")] / 1e9
        for (op, impl), sec in seconds.items():
            gbs = nbytes / sec / 1e9
            print(f"{size_mb:>4} MB  {op:<20}{impl:<7}{gbs:>9.2f}{gbs / copy_gbs:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 MB and 16 MB only")
    parser.add_argument("--chunks", type=int, default=8, help="chunk count (default 8)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [1, 16] if args.quick else [1, 16, 64]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    _run_device(torch.device("cpu"), sizes, args.chunks, args.reps)
    if torch.cuda.is_available():
        if importlib.util.find_spec("cupy") is None:
            print("\n(CUDA available but CuPy missing: GPU rows use the torch fallback)")
        _run_device(torch.device("cuda"), sizes, args.chunks, args.reps)


if __name__ == "__main__":
    main()
