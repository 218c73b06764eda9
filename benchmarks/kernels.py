"""MinMaxUInt8 compress / decompress throughput against a plain copy, measured in one run.

    python benchmarks/kernels.py             # 1 MB, 16 MB, 64 MB of float32
    python benchmarks/kernels.py --quick     # 1 MB and 16 MB

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


def _measure(
    candidates: dict[str, Callable[[], object]], iters: int, sync: Callable[[], None], reps: int
) -> dict[str, float]:
    """Median seconds per call of each candidate, repetitions interleaved."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, fn in candidates.items():
            samples[name].append(_time_per_call(fn, iters, sync))
    return {name: statistics.median(values) for name, values in samples.items()}


def _run_device(device: torch.device, sizes_mb: list[int], n_chunks: int, reps: int) -> None:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    impls = ["torch"]
    if cuda and K.cuda_kernels_available():
        impls.insert(0, "cuda")
    print(f"\n{device.type.upper()}  (n_chunks={n_chunks}, float32, median of {reps})")
    header = f"{'size':>6}  {'op':<22}{'impl':<7}{'GB/s':>9}{'vs copy':>9}"
    print(header)
    print("-" * len(header))
    for size_mb in sizes_mb:
        numel = size_mb * MB // 4
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(numel, generator=gen).to(device)
        dst = torch.empty_like(x)
        layout = K.minmax_uint8_layout(numel, n_chunks)
        buf = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        K.compress_minmax_uint8(x, n_chunks, out=buf)
        candidates: dict[str, Callable[[], object]] = {("copy", "torch"): lambda: dst.copy_(x)}
        for impl in impls:
            if impl == "cuda":
                candidates[("compress", impl)] = lambda: K.compress_minmax_uint8(
                    x, n_chunks, out=buf
                )
                candidates[("decompress", impl)] = lambda: K.decompress_minmax_uint8(
                    buf, n_chunks, numel, out=dst
                )
                candidates[("decompress_reduce", impl)] = (
                    lambda: K.decompress_reduce_minmax_uint8(buf, n_chunks, numel)
                )
            else:
                candidates[("compress", impl)] = lambda: torch_impl.compress(x, layout, buf)
                candidates[("decompress", impl)] = lambda: torch_impl.decompress(buf, layout, dst)
                candidates[("decompress_reduce", impl)] = lambda: torch_impl.decompress_reduce(
                    buf, layout, torch.empty(layout.chunk_size, device=device)
                )
        iters = max(2, min(200, int((256 if cuda else 48) * MB / (size_mb * MB))))
        seconds = _measure(candidates, iters, sync, reps)  # type: ignore[arg-type]
        copy_gbs = x.numel() * 4 / seconds[("copy", "torch")] / 1e9
        for (op, impl), sec in seconds.items():
            gbs = x.numel() * 4 / sec / 1e9
            print(f"{size_mb:>4} MB  {op:<22}{impl:<7}{gbs:>9.2f}{gbs / copy_gbs:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 MB and 16 MB only")
    parser.add_argument("--chunks", type=int, default=8, help="chunk count (default 8)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    args = parser.parse_args()
    sizes = [1, 16] if args.quick else [1, 16, 64]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    _run_device(torch.device("cpu"), sizes, args.chunks, args.reps)
    if torch.cuda.is_available():
        if importlib.util.find_spec("cupy") is None:
            print("\n(CUDA available but CuPy missing: GPU rows use the torch fallback)")
        _run_device(torch.device("cuda"), sizes, args.chunks, args.reps)


if __name__ == "__main__":
    main()
