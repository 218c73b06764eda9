"""Part 7 of ``benchmarks/gpu_check.py``: the CUDA kernels of ``baguahvd.kernels`` against
the torch oracle, and their bandwidth against a device-to-device copy.

Correctness: every public kernel entry point runs on a CUDA tensor and on a CPU copy of it
(CPU tensors take ``baguahvd.kernels.torch_impl``, the oracle); buffers and values must be
bit-identical, for float32, float16 and bfloat16, at sizes that do and do not fill whole
chunks.

Bandwidth: each kernel on 64 MiB of float32, timed with CUDA events (median of interleaved
repetitions), as uncompressed bytes per second and as a ratio to ``dst.copy_(src)`` of the
same 64 MiB (``vs_copy`` = copy time / kernel time; 1.0 is as fast as a copy). The torch
implementation running on the GPU is timed beside the compress/decompress kernels.

Runs as a plain process (no engine)::

    python benchmarks/gpu_check_kernels.py --part kernels --result out.json
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch
from gpu_check_common import Recorder, WorkerArgs, compare, needs_cuda, require, run_worker

import baguahvd.kernels as K
from baguahvd.kernels import torch_impl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = (1, 4097, 1_000_003)
CHUNKS = (1, 8)
BANDWIDTH_ELEMENTS = 16 * 2**20
"""64 MiB of float32."""
ITERATIONS, REPETITIONS = 20, 5

def values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator) * (seed + 1)).to(dtype)


Case = Callable[[torch.device, int, int], torch.Tensor]


def _kernel_cases(dtype: torch.dtype) -> dict[str, Case]:
    """Each kernel as a function of (device, numel, n_chunks) returning its output, computed
    from the same CPU inputs whatever the device (so the CPU run is the oracle)."""

    def on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(device) for t in tensors]

    def buffer(numel: int, n: int) -> torch.Tensor:
        return K.compress_minmax_uint8(values(numel, dtype, 1), n)

    def divisible(numel: int, n: int) -> int:
        return -(-numel // n) * n

    return {
        "compress": lambda d, m, n: K.compress_minmax_uint8(*on(d, values(m, dtype, 1)), n),
        "compress_target_chunk": lambda d, m, n: K.compress_minmax_uint8(
            *on(d, values(m, dtype, 2)), n, target_chunk=n - 1),
        "decompress": lambda d, m, n: K.decompress_minmax_uint8(
            *on(d, buffer(m, n)), n, m, dtype),
        "decompress_add_": lambda d, m, n: K.decompress_add_minmax_uint8_(
            *on(d, values(m, dtype, 3), buffer(m, n)), n),
        "decompress_reduce.average": lambda d, m, n: K.decompress_reduce_minmax_uint8(
            *on(d, buffer(divisible(m, n), n)), n, divisible(m, n), dtype, average=True),
        "decompress_reduce.sum": lambda d, m, n: K.decompress_reduce_minmax_uint8(
            *on(d, buffer(divisible(m, n), n)), n, divisible(m, n), dtype, average=False),
        "reduce_chunks.average": lambda d, m, n: K.reduce_chunks(
            *on(d, values(divisible(m, n), dtype, 4)), n, average=True),
        "reduce_chunks.sum": lambda d, m, n: K.reduce_chunks(
            *on(d, values(divisible(m, n), dtype, 4)), n, average=False),
        "average_": lambda d, m, n: K.average_(*on(d, values(m, dtype, 5), values(m, dtype, 6))),
        "add_": lambda d, m, n: K.add_(*on(d, values(m, dtype, 5), values(m, dtype, 6))),
        "subtract_": lambda d, m, n: K.subtract_(
            *on(d, values(m, dtype, 5), values(m, dtype, 6))),
        "addmul_": lambda d, m, n: K.addmul_(
            *on(d, values(m, dtype, 5), values(m, dtype, 6)), 0.37),
        "scale_": lambda d, m, n: K.scale_(*on(d, values(m, dtype, 5)), 1.7),
        "divide_": lambda d, m, n: K.divide_(*on(d, values(m, dtype, 5)), 3.0),
        "async_model_average_": lambda d, m, n: K.async_model_average_(
            *on(d, values(m, dtype, 5), values(m, dtype, 6), values(m, dtype, 7)), 4),
        "lowprec_decentralized_diff_": lambda d, m, n: K.lowprec_decentralized_diff_(
            *on(d, values(m, dtype, 5), values(m, dtype, 6), values(m, dtype, 7),
                values(m, dtype, 8))),
    }


def kernels(rec: Recorder, args: WorkerArgs) -> None:
    device = args.device

    def available() -> str:
        needs_cuda(device)
        require(K.cuda_kernels_available(), "CuPy cannot be imported: CUDA tensors would "
                                            "take the torch fallback")
        K.compress_minmax_uint8(torch.ones(10, device=device))
        torch.cuda.synchronize(device)
        fallbacks = [w for w in rec.warnings.messages if "kernels" in w]
        require(not fallbacks, f"the kernels fell back to torch: {fallbacks}")
        return "compiled through CuPy's NVRTC; no fallback warning"

    rec.check("compiled", available)
    for dtype in DTYPES:
        for name, case in _kernel_cases(dtype).items():
            def body(case: Case = case) -> str:
                compared = 0
                for numel in SIZES:
                    for n in CHUNKS:
                        compare(case(device, numel, n), case(torch.device("cpu"), numel, n),
                                tol=0)
                        compared += 1
                return f"bit-identical to the torch oracle in {compared} cases"

            rec.check(f"{name}.{str(dtype).replace('torch.', '')}", body)

    rec.check("bandwidth", lambda: bandwidth(rec, device))


def bandwidth(rec: Recorder, device: torch.device) -> str:
    """Times every kernel on 64 MiB of float32 against a copy of the same bytes."""
    needs_cuda(device)
    n_chunks = 8
    numel = BANDWIDTH_ELEMENTS
    x = values(numel, torch.float32, 1).to(device)
    y, w, left, right = (values(numel, torch.float32, s).to(device) for s in (2, 3, 4, 5))
    dst = torch.empty_like(x)
    layout = K.minmax_uint8_layout(numel, n_chunks)
    buf = K.compress_minmax_uint8(x, n_chunks)
    reduced = torch.empty(layout.chunk_size, device=device)
    rows: dict[tuple[str, str], Callable[[], object]] = {
        ("copy", "torch"): lambda: dst.copy_(x),
        ("compress", "cuda"): lambda: K.compress_minmax_uint8(x, n_chunks, out=buf),
        ("decompress", "cuda"): lambda: K.decompress_minmax_uint8(buf, n_chunks, numel,
                                                                  out=dst),
        ("decompress_add_", "cuda"): lambda: K.decompress_add_minmax_uint8_(dst, buf,
                                                                            n_chunks),
        ("decompress_reduce", "cuda"): lambda: K.decompress_reduce_minmax_uint8(
            buf, n_chunks, numel, out=reduced),
        ("reduce_chunks", "cuda"): lambda: K.reduce_chunks(x, n_chunks, out=reduced),
        ("add_", "cuda"): lambda: K.add_(dst, y),
        ("average_", "cuda"): lambda: K.average_(dst, y),
        ("addmul_", "cuda"): lambda: K.addmul_(dst, y, 0.5),
        ("scale_", "cuda"): lambda: K.scale_(dst, 0.999),
        ("async_model_average_", "cuda"): lambda: K.async_model_average_(dst, y, w, 2),
        ("lowprec_decentralized_diff_", "cuda"): lambda: K.lowprec_decentralized_diff_(
            dst, w, left, right),
        ("compress", "torch"): lambda: torch_impl.compress(x, layout, buf),
        ("decompress", "torch"): lambda: torch_impl.decompress(buf, layout, dst),
        ("decompress_reduce", "torch"): lambda: torch_impl.decompress_reduce(
            buf, layout, reduced),
    }
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in rows}
    for fn in rows.values():
        fn()
        fn()
    torch.cuda.synchronize(device)
    for _ in range(REPETITIONS):
        for key, fn in rows.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(ITERATIONS):
                fn()
            end.record()
            end.synchronize()
            samples[key].append(start.elapsed_time(end) / ITERATIONS)
    nbytes = numel * 4
    copy_ms = statistics.median(samples[("copy", "torch")])
    table = []
    for (op, impl), times in samples.items():
        ms = statistics.median(times)
        require(ms > 0, f"{op} ({impl}) took {ms} ms")
        table.append({"op": op, "impl": impl, "ms": round(ms, 4),
                      "GB/s": round(nbytes / ms / 1e6, 1), "vs_copy": round(copy_ms / ms, 3)})
    rec.data["bandwidth"] = table
    rec.data["bandwidth_setup"] = (f"{nbytes / 2**20:g} MiB float32, {n_chunks} chunks, "
                                   f"median of {REPETITIONS} x {ITERATIONS} calls, CUDA events")
    compress = next(r for r in table if r["op"] == "compress" and r["impl"] == "cuda")
    return (f"copy {nbytes / copy_ms / 1e6:.0f} GB/s; compress {compress['vs_copy']} of a "
            "copy (table in data.bandwidth)")


if __name__ == "__main__":
    sys.exit(run_worker({"kernels": kernels}, engine=False))
