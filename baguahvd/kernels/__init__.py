"""Compression and elementwise kernels: CUDA (``csrc/``, through CuPy) with a torch fallback.

Importing this package never imports CuPy; that waits for the first CUDA tensor.
"""

from baguahvd.kernels.layout import (
    DTYPE_SUFFIXES,
    HEADER_BYTES,
    MAX_CHUNKS,
    MinMaxUInt8Layout,
    minmax_uint8_layout,
)
from baguahvd.kernels.ops import (
    add_,
    addmul_,
    async_model_average_,
    average_,
    compress_minmax_uint8,
    cuda_kernels_available,
    decompress_add_minmax_uint8_,
    decompress_minmax_uint8,
    decompress_reduce_minmax_uint8,
    divide_,
    lowprec_decentralized_diff_,
    reduce_chunks,
    scale_,
    subtract_,
)

__all__ = [
    "DTYPE_SUFFIXES",
    "HEADER_BYTES",
    "MAX_CHUNKS",
    "MinMaxUInt8Layout",
    "add_",
    "addmul_",
    "async_model_average_",
    "average_",
    "compress_minmax_uint8",
    "cuda_kernels_available",
    "decompress_add_minmax_uint8_",
    "decompress_minmax_uint8",
    "decompress_reduce_minmax_uint8",
    "divide_",
    "lowprec_decentralized_diff_",
    "minmax_uint8_layout",
    "reduce_chunks",
    "scale_",
    "subtract_",
]
