"""MinMaxUInt8 buffer layout and the argument checks shared by every kernel entry point.

A flat tensor of ``numel`` elements is cut into ``n_chunks`` chunks of
``chunk_size = ceil(numel / n_chunks)`` elements; the last chunks may be short or empty when
``numel`` is not a multiple of ``n_chunks``. Chunk ``j`` is stored in the slot of
``slot_bytes = roundup(chunk_size, 32) + 32`` bytes that starts at byte ``j * slot_bytes``:

* bytes ``[0, 2 * itemsize)``: min then max of the chunk in the source dtype (little endian);
* bytes ``[2 * itemsize, 32)``: zero;
* bytes ``[32, 32 + chunk_size)``: one uint8 code per element (0 past the tensor's end);
* then zero padding up to ``slot_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER_BYTES = 32
"""Bytes of a chunk header (min, max, zero padding)."""

MAX_CHUNKS = 65535
"""Largest chunk count: the CUDA kernels put the chunk index on the grid's y axis."""

DTYPE_SUFFIXES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}
"""Supported floating dtypes and the suffix of their CUDA entry points."""

NAN_BITS: dict[torch.dtype, int] = {
    torch.float32: 0x7FC00000,
    torch.float16: 0x7E00,
    torch.bfloat16: 0x7FC0,
}
"""Bit pattern of the NaN written into the header of a chunk that holds a NaN or an Inf."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class MinMaxUInt8Layout:
    """Where every chunk of a MinMaxUInt8 buffer lives.

    Attributes:
        numel: Elements of the uncompressed tensor.
        n_chunks: Chunks the tensor is cut into (the world size in scatter-gather use).
    """

    numel: int
    n_chunks: int

    def __post_init__(self) -> None:
        if isinstance(self.n_chunks, bool) or not isinstance(self.n_chunks, int):
            raise TypeError(f"n_chunks must be an int, got {type(self.n_chunks).__name__}")
        if not 1 <= self.n_chunks <= MAX_CHUNKS:
            raise ValueError(f"n_chunks must be in [1, {MAX_CHUNKS}], got {self.n_chunks}")
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")

    @property
    def chunk_size(self) -> int:
        """Elements per chunk, ``ceil(numel / n_chunks)``."""
        return -(-self.numel // self.n_chunks)

    @property
    def slot_bytes(self) -> int:
        """Bytes per chunk slot, ``roundup(chunk_size, 32) + 32``."""
        return _round_up(self.chunk_size, HEADER_BYTES) + HEADER_BYTES

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole compressed buffer, ``n_chunks * slot_bytes``."""
        return self.n_chunks * self.slot_bytes

    @property
    def divisible(self) -> bool:
        """Whether every chunk is full (``numel`` is a multiple of ``n_chunks``)."""
        return self.chunk_size * self.n_chunks == self.numel

    def chunk_valid(self, chunk: int) -> int:
        """Elements of chunk ``chunk`` that exist in the tensor (0 for a trailing empty one)."""
        return min(max(self.numel - chunk * self.chunk_size, 0), self.chunk_size)


def minmax_uint8_layout(numel: int, n_chunks: int = 1) -> MinMaxUInt8Layout:
    """Returns the layout of the MinMaxUInt8 buffer of a tensor.

    Args:
        numel: Elements of the uncompressed tensor.
        n_chunks: Chunks, each with its own min and max.

    Returns:
        The layout; ``total_bytes`` is the size of the uint8 buffer.

    Raises:
        ValueError: ``n_chunks`` outside ``[1, 65535]`` or a negative ``numel``.
    """
    return MinMaxUInt8Layout(int(numel), n_chunks)


def dtype_suffix(dtype: torch.dtype) -> str:
    """Returns the CUDA entry point suffix of ``dtype``.

    Raises:
        TypeError: ``dtype`` is not float32, float16 or bfloat16.
    """
    try:
        return DTYPE_SUFFIXES[dtype]
    except KeyError:
        known = ", ".join(str(d) for d in DTYPE_SUFFIXES)
        raise TypeError(f"unsupported dtype {dtype}; the kernels take {known}") from None


def check_flat(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Returns ``tensor`` as a flat view after checking its dtype and contiguity.

    Raises:
        TypeError: unsupported dtype or not a tensor.
        ValueError: the tensor is not contiguous (the kernels work on its memory in place).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    dtype_suffix(tensor.dtype)
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous; call .contiguous() first")
    return tensor.view(-1)


def check_like(tensor: torch.Tensor, reference: torch.Tensor, what: str) -> torch.Tensor:
    """Checks that ``tensor`` matches ``reference`` in dtype, device and numel; returns it flat.

    Raises:
        TypeError: different dtype.
        ValueError: different device or numel, or not contiguous.
    """
    flat = check_flat(tensor, what)
    if tensor.dtype != reference.dtype:
        raise TypeError(f"{what} has dtype {tensor.dtype} but {reference.dtype} was expected")
    if tensor.device != reference.device:
        raise ValueError(f"{what} is on {tensor.device} but {reference.device} was expected")
    if flat.numel() != reference.numel():
        raise ValueError(
            f"{what} has {flat.numel()} elements but {reference.numel()} were expected"
        )
    return flat


def check_buffer(
    buffer: torch.Tensor, layout: MinMaxUInt8Layout, device: torch.device, what: str = "buffer"
) -> torch.Tensor:
    """Checks a compressed buffer against its layout; returns it flat.

    Raises:
        TypeError: not a uint8 tensor.
        ValueError: wrong size or device, or not contiguous.
    """
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8:
        got = buffer.dtype if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise TypeError(f"{what} must be a uint8 tensor, got {got}")
    if not buffer.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    if buffer.numel() != layout.total_bytes:
        raise ValueError(
            f"{what} has {buffer.numel()} bytes but {layout.total_bytes} were expected for "
            f"{layout.numel} elements in {layout.n_chunks} chunks"
        )
    if buffer.device != device:
        raise ValueError(f"{what} is on {buffer.device} but {device} was expected")
    return buffer.view(-1)
