"""Public kernel entry points: check arguments, then run the CUDA kernels or the torch ops.

CUDA tensors go to the kernels compiled from ``csrc/`` (through CuPy, on the current torch
stream); CPU tensors, and CUDA tensors when CuPy is missing, go to
:mod:`baguahvd.kernels.torch_impl`, which computes bit-identical results. Every tensor must
be contiguous and of dtype float32, float16 or bfloat16; it is used as a flat array.

MinMaxUInt8 (Bagua's 8-bit compressor; layout in :mod:`baguahvd.kernels.layout`): each chunk
keeps its own min and max, ``scale = 255 / (max - min + 1e-7)``, an element x is stored as
``min(rint(x * scale), rint(max * scale)) - (rint(max * scale) - 255)`` saturated to
``[0, 255]`` and decodes to ``(code + lower) / scale``, all in fp32 with round-half-even.
A chunk holding a NaN or an Inf decodes to all NaN; so does a chunk whose range overflows
fp32. Inputs of magnitude above ~1e29 in a nearly constant chunk decode to Inf.
"""

from __future__ import annotations

import torch

from baguahvd.kernels import torch_impl
from baguahvd.kernels.cuda import CudaKernelLoader, CudaKernels
from baguahvd.kernels.layout import (
    MinMaxUInt8Layout,
    check_buffer,
    check_flat,
    check_like,
    dtype_suffix,
    minmax_uint8_layout,
)

# The loader owns all CUDA state (CuPy handle, compiled modules per device); this name is
# bound once and never rebound.
_LOADER = CudaKernelLoader()


def _cuda_kernels(tensor: torch.Tensor) -> CudaKernels | None:
    if tensor.device.type != "cuda":
        return None
    return _LOADER.kernels_for(tensor.device)


def cuda_kernels_available() -> bool:
    """Whether CUDA tensors will run the compiled kernels (CuPy is importable).

    Importing CuPy happens here at the latest; importing :mod:`baguahvd.kernels` never does.
    """
    return _LOADER.available()


def _check_target(target_chunk: int | None, layout: MinMaxUInt8Layout) -> int | None:
    if target_chunk is None:
        return None
    if isinstance(target_chunk, bool) or not isinstance(target_chunk, int):
        raise TypeError(f"target_chunk must be an int or None, got {type(target_chunk).__name__}")
    if not 0 <= target_chunk < layout.n_chunks:
        raise ValueError(
            f"target_chunk {target_chunk} is out of range for {layout.n_chunks} chunks"
        )
    return target_chunk


def _check_divisible(layout: MinMaxUInt8Layout, what: str) -> None:
    if not layout.divisible:
        raise ValueError(
            f"{what} needs numel divisible by n_chunks, got {layout.numel} elements in "
            f"{layout.n_chunks} chunks; pad the tensor with zeros first"
        )


def _check_out(
    out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    flat = check_flat(out, "out")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype} but {dtype} was expected")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but {device} was expected")
    if flat.numel() != numel:
        raise ValueError(f"out has {flat.numel()} elements but {numel} were expected")
    return flat


@torch.no_grad()
def compress_minmax_uint8(
    tensor: torch.Tensor,
    n_chunks: int = 1,
    *,
    target_chunk: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compresses a tensor into a MinMaxUInt8 buffer, one min/max per chunk.

    Args:
        tensor: Contiguous float32/float16/bfloat16 tensor, used flat. Its element count need
            not be a multiple of ``n_chunks``: the last chunks are then short (or empty), and
            their min/max only cover the elements that exist.
        n_chunks: Chunks, each with its own min and max (the world size in scatter-gather
            use, 1 for the low-precision decentralized algorithm).
        target_chunk: Compress only this chunk into its slot (ByteGrad's reduced chunk); the
            other slots of ``out`` are left untouched (zero when ``out`` is None).
        out: Destination uint8 buffer of ``minmax_uint8_layout(numel, n_chunks).total_bytes``
            bytes on the tensor's device; allocated when None.

    Returns:
        The uint8 buffer (``out`` when given).

    Raises:
        TypeError: unsupported dtype, or ``out`` is not uint8.
        ValueError: non-contiguous tensors, a bad chunk count, target or buffer size.
    """
    flat = check_flat(tensor, "tensor")
    layout = minmax_uint8_layout(flat.numel(), n_chunks)
    target = _check_target(target_chunk, layout)
    if out is None:
        alloc = torch.zeros if target is not None else torch.empty
        buffer = alloc(layout.total_bytes, dtype=torch.uint8, device=flat.device)
    else:
        buffer = check_buffer(out, layout, flat.device, "out")
    kernels = _cuda_kernels(flat)
    if kernels is not None:
        kernels.compress(flat, layout, buffer, target)
    else:
        torch_impl.compress(flat, layout, buffer, target)
    return buffer if out is None else out


@torch.no_grad()
def decompress_minmax_uint8(
    buffer: torch.Tensor,
    n_chunks: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decompresses a MinMaxUInt8 buffer.

    Args:
        buffer: uint8 buffer written by :func:`compress_minmax_uint8`.
        n_chunks: Chunk count it was compressed with.
        numel: Element count of the original tensor.
        dtype: dtype of the original tensor (the header stores min/max in it).
        out: Destination tensor of ``numel`` elements of ``dtype``; allocated (flat) when None.

    Returns:
        The decoded tensor (``out`` when given).

    Raises:
        TypeError: unsupported dtype or a non-uint8 buffer.
        ValueError: buffer size, device or ``out`` shape mismatch.
    """
    dtype_suffix(dtype)
    layout = minmax_uint8_layout(numel, n_chunks)
    flat_buffer = check_buffer(buffer, layout, buffer.device)
    result = _check_out(out, layout.numel, dtype, buffer.device)
    kernels = _cuda_kernels(flat_buffer)
    if kernels is not None:
        kernels.decompress(flat_buffer, layout, result)
    else:
        torch_impl.decompress(flat_buffer, layout, result)
    return result if out is None else out


@torch.no_grad()
def decompress_add_minmax_uint8_(
    tensor: torch.Tensor, buffer: torch.Tensor, n_chunks: int = 1
) -> torch.Tensor:
    """Adds the decoded buffer to a tensor in place: ``tensor += decompress(buffer)``.

    The decoded values are rounded to the tensor's dtype before the fp32 addition, so this
    equals :func:`decompress_minmax_uint8` followed by :func:`add_`. The low-precision
    decentralized algorithm applies every rank's quantized diff with it, to the rank's own
    replica and to its neighbours' copies alike, which keeps the replicas bit-identical.

    Args:
        tensor: Tensor the buffer was compressed from (same dtype and element count).
        buffer: uint8 buffer written by :func:`compress_minmax_uint8`.
        n_chunks: Chunk count it was compressed with.

    Returns:
        ``tensor``.
    """
    flat = check_flat(tensor, "tensor")
    layout = minmax_uint8_layout(flat.numel(), n_chunks)
    flat_buffer = check_buffer(buffer, layout, flat.device)
    kernels = _cuda_kernels(flat)
    if kernels is not None:
        kernels.decompress_add_(flat, flat_buffer, layout)
    else:
        torch_impl.decompress_add_(flat, flat_buffer, layout)
    return tensor


@torch.no_grad()
def decompress_reduce_minmax_uint8(
    buffer: torch.Tensor,
    n_chunks: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
    *,
    average: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decodes the ``n_chunks`` chunks of a buffer and reduces them into one chunk.

    ByteGrad's local reduction after the compressed alltoall, fused: equals
    :func:`decompress_minmax_uint8` followed by :func:`reduce_chunks`, without materializing
    the decoded tensor.

    Args:
        buffer: uint8 buffer of ``n_chunks`` slots.
        n_chunks: Chunk count; ``numel`` must be a multiple of it.
        numel: Element count of the whole (uncompressed) tensor.
        dtype: dtype of the original tensor.
        average: Divide the sum by ``n_chunks``.
        out: Destination of ``numel // n_chunks`` elements; allocated when None.

    Returns:
        The reduced chunk (``out`` when given).
    """
    dtype_suffix(dtype)
    layout = minmax_uint8_layout(numel, n_chunks)
    _check_divisible(layout, "decompress_reduce_minmax_uint8")
    flat_buffer = check_buffer(buffer, layout, buffer.device)
    result = _check_out(out, layout.chunk_size, dtype, buffer.device)
    kernels = _cuda_kernels(flat_buffer)
    if kernels is not None:
        kernels.decompress_reduce(flat_buffer, layout, result, average)
    else:
        torch_impl.decompress_reduce(flat_buffer, layout, result, average)
    return result if out is None else out


@torch.no_grad()
def reduce_chunks(
    tensor: torch.Tensor,
    n_chunks: int,
    *,
    average: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sums (or averages) the ``n_chunks`` equal chunks of a tensor elementwise.

    Accumulates in fp32 as a pairwise tree over the chunks (the same order on every device),
    then rounds once to the dtype.

    Args:
        tensor: Tensor whose element count is a multiple of ``n_chunks``.
        n_chunks: Number of chunks.
        average: Divide the sum by ``n_chunks``.
        out: Destination of ``numel // n_chunks`` elements; may be one of the chunks of
            ``tensor`` (in-place reduction into slot r). Allocated when None.

    Returns:
        The reduced chunk (``out`` when given).
    """
    flat = check_flat(tensor, "tensor")
    layout = minmax_uint8_layout(flat.numel(), n_chunks)
    _check_divisible(layout, "reduce_chunks")
    result = _check_out(out, layout.chunk_size, flat.dtype, flat.device)
    kernels = _cuda_kernels(flat)
    if kernels is not None:
        kernels.reduce_chunks(flat, n_chunks, result, average)
    else:
        torch_impl.reduce_chunks(flat, n_chunks, result, average)
    return result if out is None else out


@torch.no_grad()
def _elementwise(
    op: str, x: torch.Tensor, others: tuple[torch.Tensor, ...], scalars: tuple[float, ...] = ()
) -> torch.Tensor:
    flat = check_flat(x, "x")
    flats = [check_like(t, x, f"operand {i + 1}") for i, t in enumerate(others)]
    kernels = _cuda_kernels(flat)
    if kernels is not None:
        kernels.elementwise(op, [flat, *flats], scalars)
    else:
        getattr(torch_impl, _TORCH_OPS[op])(flat, *flats, *scalars)
    return x


_TORCH_OPS = {
    "average_inplace": "average_",
    "add_inplace": "add_",
    "subtract_inplace": "subtract_",
    "addmul_inplace": "addmul_",
    "scale_inplace": "scale_",
    "divide_inplace": "divide_",
    "async_model_average": "async_model_average_",
    "lowprec_decentralized_diff": "lowprec_decentralized_diff_",
}


def average_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In place ``x = (x + y) / 2`` (decentralized shift_one peer averaging).

    Computed in fp32 and rounded once to the dtype, like every elementwise kernel here.

    Args:
        x: Tensor updated in place.
        y: Tensor of the same dtype, device and element count.

    Returns:
        ``x``.
    """
    return _elementwise("average_inplace", x, (y,))


def add_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In place ``x = x + y``. See :func:`average_`."""
    return _elementwise("add_inplace", x, (y,))


def subtract_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In place ``x = x - y``. See :func:`average_`."""
    return _elementwise("subtract_inplace", x, (y,))


def addmul_(x: torch.Tensor, y: torch.Tensor, factor: float) -> torch.Tensor:
    """In place ``x = x + factor * y`` (fp32 product, then fp32 sum). See :func:`average_`."""
    return _elementwise("addmul_inplace", x, (y,), (float(factor),))


def scale_(x: torch.Tensor, factor: float) -> torch.Tensor:
    """In place ``x = x * factor`` (fp32 factor). See :func:`average_`."""
    return _elementwise("scale_inplace", x, (), (float(factor),))


def divide_(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """In place ``x = x / divisor`` (a true division, for AVG as SUM then divide)."""
    return _elementwise("divide_inplace", x, (), (float(divisor),))


def async_model_average_(
    weights: torch.Tensor, reduced: torch.Tensor, snapshot: torch.Tensor, nranks: int
) -> torch.Tensor:
    """Async model average update, in place: ``w = w + (reduced / nranks - snapshot)``.

    ``reduced`` is the allreduce-SUM of every rank's ``snapshot``; progress the local model
    made since the snapshot is kept (Bagua's ``async_model_average`` kernel, extended from
    fp32 to fp16 and bf16).

    Args:
        weights: Live flat weights, updated in place.
        reduced: Sum of all ranks' snapshots.
        snapshot: This rank's snapshot that went into ``reduced``.
        nranks: Ranks that contributed to ``reduced``.

    Returns:
        ``weights``.
    """
    return _elementwise("async_model_average", weights, (reduced, snapshot), (float(nranks),))


def lowprec_decentralized_diff_(
    x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor
) -> torch.Tensor:
    """Low-precision decentralized diff, in place: ``x = x + l/3 + r/3 - 5w/3``.

    ``x`` holds the weights after the local optimizer step, ``weight`` the public replica of
    this rank's model, ``left``/``right`` the replicas of the ring neighbours. The result is
    the local update plus the gossip correction with mixing weights 1/3, evaluated as
    ``(x - w) + ((l - w) + (r - w)) / 3`` so nearly equal replicas do not cancel. It is then
    compressed with one chunk and applied with :func:`decompress_add_minmax_uint8_`.

    Returns:
        ``x``.
    """
    return _elementwise("lowprec_decentralized_diff", x, (weight, left, right))
