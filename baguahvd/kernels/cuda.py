"""Launches the ``csrc/*.cu`` kernels on CUDA tensors through CuPy's NVRTC.

Nothing here runs at import time. The first CUDA tensor that reaches a kernel makes the
loader import CuPy (in :func:`_import_cupy`, the only place this package touches it),
compile the sources once per device with ``cupy.RawModule`` and keep the module. Kernels run
on the tensor's current torch stream and see the tensors' memory through DLPack, without
copies. Without CuPy the loader reports that once and the callers fall back to torch.

The launch geometry mirrors the constants at the top of ``csrc/baguahvd_math.cuh``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from baguahvd.kernels import cupy_api
from baguahvd.kernels.layout import HEADER_BYTES, MinMaxUInt8Layout, dtype_suffix
from baguahvd.kernels.sources import NVRTC_OPTIONS, nvrtc_source

logger = logging.getLogger(__name__)

THREADS = 256
HEADER_THREADS = 32
MAX_BLOCKS = 4096
MINMAX_ITEMS_PER_THREAD = 16
MAX_MINMAX_BLOCKS = 128
MINMAX_BLOCKS_PER_SM = 8

Launch = tuple[str, tuple[int, ...], int, Sequence[object]]
"""One kernel launch: name, grid, threads per block, arguments."""

KERNELS = (
    "minmax_uint8_partial",
    "minmax_uint8_header",
    "compress_minmax_uint8",
    "decompress_minmax_uint8",
    "decompress_add_minmax_uint8",
    "decompress_reduce_minmax_uint8",
    "reduce_chunks",
    "average_inplace",
    "add_inplace",
    "subtract_inplace",
    "addmul_inplace",
    "scale_inplace",
    "divide_inplace",
    "async_model_average",
    "lowprec_decentralized_diff",
)
"""Kernel families; each exists as ``<family>_<f32|f16|bf16>`` (``extern "C"``)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def grid_blocks(work: int) -> int:
    """Blocks of a grid-stride launch over ``work`` items (``bhvd::grid_blocks``)."""
    return min(max(_ceil_div(work, THREADS), 1), MAX_BLOCKS)


def minmax_blocks_per_chunk(chunk: int, rows: int = 1, sm_count: int = 0) -> int:
    """Blocks per chunk of the min/max first pass (``bhvd::minmax_blocks_per_chunk``):
    enough to cover the chunk, capped at :data:`MAX_MINMAX_BLOCKS` or, on a device of
    ``sm_count`` SMs, at what fills it across the ``rows`` chunks of the launch."""
    cap = max(MAX_MINMAX_BLOCKS, _ceil_div(sm_count * MINMAX_BLOCKS_PER_SM, max(rows, 1)))
    return min(max(_ceil_div(chunk, THREADS * MINMAX_ITEMS_PER_THREAD), 1), cap)


def _sm_count(device: torch.device) -> int:
    """The device's SM count; 0 (unknown) where torch cannot tell."""
    try:
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    except (AssertionError, RuntimeError, AttributeError):
        return 0


def _import_cupy() -> Any | None:
    # The one CuPy import of the kernels package (DESIGN.md keeps CuPy behind explicit seams):
    # deferred to the first CUDA tensor because importing CuPy is slow and needs a driver.
    try:
        import cupy
    except ImportError:
        return None
    return cupy


class CudaKernels:
    """The compiled kernels of one device and the launches that use them."""

    def __init__(self, cupy: Any, module: Any, device: torch.device) -> None:
        self._cupy = cupy
        self._module = module
        self._device = device
        self._functions: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._sm_count = _sm_count(device)

    def _function(self, name: str) -> Any:
        with self._lock:
            fn = self._functions.get(name)
            if fn is None:
                fn = self._module.get_function(name)
                self._functions[name] = fn
            return fn

    def _array(self, tensor: torch.Tensor) -> Any:
        # DLPack refuses tensors that require grad; the kernels only touch their data.
        tensor = tensor.detach()
        # CuPy has no bfloat16; 16-bit tensors travel as their raw words.
        if tensor.element_size() == 2 and tensor.is_floating_point():
            tensor = tensor.view(torch.int16)
        return self._cupy.from_dlpack(tensor)

    def _launch(self, *launches: Launch) -> None:
        """Runs ``launches`` in order on the device's current torch stream.

        Each distinct tensor argument is handed to CuPy (DLPack, no copy) once per call.
        """
        cupy = self._cupy
        index = self._device.index
        torch_stream = torch.cuda.current_stream(self._device)
        arrays: dict[int, Any] = {}
        with cupy.cuda.Device(index):
            # RawKernel launches on CuPy's current stream: make it torch's.
            with cupy_api.external_stream(cupy, torch_stream.cuda_stream, index):
                for name, grid, block, args in launches:
                    converted = []
                    for arg in args:
                        if isinstance(arg, torch.Tensor):
                            if id(arg) not in arrays:
                                arrays[id(arg)] = self._array(arg)
                            arg = arrays[id(arg)]
                        converted.append(arg)
                    self._function(name)(grid, (block,), tuple(converted))

    def compress(
        self,
        tensor: torch.Tensor,
        layout: MinMaxUInt8Layout,
        out: torch.Tensor,
        target_chunk: int | None,
    ) -> torch.Tensor:
        """See :func:`baguahvd.kernels.torch_impl.compress`."""
        sfx = dtype_suffix(tensor.dtype)
        chunk, slot = layout.chunk_size, layout.slot_bytes
        first = 0 if target_chunk is None else target_chunk
        rows = layout.n_chunks if target_chunk is None else 1
        blocks = minmax_blocks_per_chunk(chunk, rows, self._sm_count)
        workspace = torch.empty(2 * rows * blocks, dtype=torch.float32, device=tensor.device)
        numel, chunk_ll, slot_ll = np.int64(layout.numel), np.int64(chunk), np.int64(slot)
        first_i = np.int32(first)
        self._launch(
            (
                f"minmax_uint8_partial_{sfx}",
                (blocks, rows),
                THREADS,
                (tensor, numel, chunk_ll, first_i, workspace),
            ),
            (
                f"minmax_uint8_header_{sfx}",
                (rows,),
                HEADER_THREADS,
                (workspace, np.int32(blocks), numel, chunk_ll, first_i, out, slot_ll),
            ),
            (
                f"compress_minmax_uint8_{sfx}",
                (grid_blocks(slot - HEADER_BYTES), rows),
                THREADS,
                (tensor, numel, chunk_ll, first_i, out, slot_ll),
            ),
        )
        return out

    def decompress(
        self, buffer: torch.Tensor, layout: MinMaxUInt8Layout, out: torch.Tensor
    ) -> torch.Tensor:
        """See :func:`baguahvd.kernels.torch_impl.decompress`."""
        if layout.numel:
            self._launch(
                (
                    f"decompress_minmax_uint8_{dtype_suffix(out.dtype)}",
                    (grid_blocks(layout.chunk_size), layout.n_chunks),
                    THREADS,
                    (
                        buffer,
                        np.int64(layout.numel),
                        np.int64(layout.chunk_size),
                        np.int64(layout.slot_bytes),
                        out,
                    ),
                )
            )
        return out

    def decompress_add_(
        self, tensor: torch.Tensor, buffer: torch.Tensor, layout: MinMaxUInt8Layout
    ) -> torch.Tensor:
        """See :func:`baguahvd.kernels.torch_impl.decompress_add_`."""
        if layout.numel:
            self._launch(
                (
                    f"decompress_add_minmax_uint8_{dtype_suffix(tensor.dtype)}",
                    (grid_blocks(layout.chunk_size), layout.n_chunks),
                    THREADS,
                    (
                        buffer,
                        np.int64(layout.numel),
                        np.int64(layout.chunk_size),
                        np.int64(layout.slot_bytes),
                        tensor,
                    ),
                )
            )
        return tensor

    def decompress_reduce(
        self,
        buffer: torch.Tensor,
        layout: MinMaxUInt8Layout,
        out: torch.Tensor,
        average: bool,
    ) -> torch.Tensor:
        """See :func:`baguahvd.kernels.torch_impl.decompress_reduce`."""
        if layout.chunk_size:
            self._launch(
                (
                    f"decompress_reduce_minmax_uint8_{dtype_suffix(out.dtype)}",
                    (grid_blocks(layout.chunk_size),),
                    THREADS,
                    (
                        buffer,
                        np.int32(layout.n_chunks),
                        np.int64(layout.chunk_size),
                        np.int64(layout.slot_bytes),
                        np.int32(average),
                        out,
                    ),
                )
            )
        return out

    def reduce_chunks(
        self, tensor: torch.Tensor, n_chunks: int, out: torch.Tensor, average: bool
    ) -> torch.Tensor:
        """See :func:`baguahvd.kernels.torch_impl.reduce_chunks`."""
        chunk = tensor.numel() // n_chunks
        if chunk:
            self._launch(
                (
                    f"reduce_chunks_{dtype_suffix(tensor.dtype)}",
                    (grid_blocks(chunk),),
                    THREADS,
                    (tensor, np.int32(n_chunks), np.int64(chunk), np.int32(average), out),
                )
            )
        return out

    def elementwise(
        self, op: str, tensors: Sequence[torch.Tensor], scalars: Sequence[float] = ()
    ) -> torch.Tensor:
        """Runs the in-place elementwise kernel ``<op>_<dtype>`` on ``tensors[0]``.

        The kernel signature is ``(tensors..., scalars as float..., long long n)``.
        """
        x = tensors[0]
        n = x.numel()
        if n:
            args: list[object] = list(tensors)
            args.extend(np.float32(s) for s in scalars)
            args.append(np.int64(n))
            self._launch((f"{op}_{dtype_suffix(x.dtype)}", (grid_blocks(n),), THREADS, args))
        return x


class CudaKernelLoader:
    """Compiles the kernels once per device, on first use, and hands them out.

    Thread-safe. Holds all the loader's state (CuPy module, compiled modules per device), so
    that nothing mutable lives at module level.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cupy: Any | None = None
        self._probed = False
        self._kernels: dict[int, CudaKernels] = {}
        self._failed: set[int] = set()
        """Devices whose compile failed: their kernels run as torch ops."""

    def _cupy_module(self) -> Any | None:
        if not self._probed:
            self._probed = True
            self._cupy = _import_cupy()
            if self._cupy is None:
                logger.warning(
                    "CuPy is not installed: baguahvd kernels on CUDA tensors run as torch ops "
                    "(slower); install cupy-cuda12x for the CUDA kernels"
                )
        return self._cupy

    def available(self) -> bool:
        """Whether CuPy can be imported (the CUDA kernels can be used at all)."""
        with self._lock:
            return self._cupy_module() is not None

    def kernels_for(self, device: torch.device) -> CudaKernels | None:
        """Returns the compiled kernels for a CUDA ``device``, or None without CuPy or when
        they cannot be compiled there (NVRTC missing, an unsupported GPU): the callers then
        run the torch implementation. A failed compile is reported once per device."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            kernels = self._kernels.get(index)
            if kernels is not None:
                return kernels
            cupy = self._cupy_module()
            if cupy is None or index in self._failed:
                return None
            with cupy.cuda.Device(index):
                try:
                    module = cupy.RawModule(code=nvrtc_source(), options=NVRTC_OPTIONS)
                    module.compile()
                except Exception as exc:  # noqa: BLE001 - any failure means: use torch
                    self._failed.add(index)
                    logger.warning(
                        "compiling the baguahvd CUDA kernels for cuda:%d failed, so they run "
                        "as torch ops (slower): %s. CuPy 14 needs NVRTC from the CUDA "
                        "toolkit or `pip install nvidia-cuda-nvrtc-cu12` (included in "
                        "baguahvd[cuda12]).", index, exc,
                    )
                    return None
            kernels = CudaKernels(cupy, module, torch.device("cuda", index))
            self._kernels[index] = kernels
            return kernels
