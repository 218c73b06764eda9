"""Inputs shared by the kernel tests: named tensors that probe the corners of MinMaxUInt8.

``compress_cases()`` yields ``(name, tensor, n_chunks)``; tensors are float32 and are cast
to the dtype under test by the caller (``cast``), which can turn huge values into Inf in
fp16 and so exercise the non-finite policy there too.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from baguahvd.kernels.layout import DTYPE_SUFFIXES

REFERENCE_DIR = Path(__file__).resolve().parent
DTYPES = {suffix: dtype for dtype, suffix in DTYPE_SUFFIXES.items()}
"""The kernels' dtypes by the suffix of their entry points (``f32``, ...)."""


def load_reference(name: str) -> ModuleType:
    """Imports ``tests/reference/<name>.py`` by path (tests/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REFERENCE_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def compress_cases() -> Iterator[tuple[str, torch.Tensor, int]]:
    """Named float32 inputs with the chunk counts to compress them with."""
    g = _gen(1234)
    yield "randn_1", torch.randn(1000, generator=g), 1
    yield "randn_4", torch.randn(4096, generator=g), 4
    yield "randn_8_scaled", torch.randn(1024, generator=g) * 1e-3, 8
    yield "uneven_1001_4", torch.randn(1001, generator=g), 4
    yield "uneven_37_5", torch.randn(37, generator=g), 5
    yield "empty_chunks_5_8", torch.randn(5, generator=g), 8  # chunk 1: chunks 5..7 empty
    yield "empty_0_3", torch.empty(0), 3
    yield "one_1", torch.tensor([0.25]), 1
    yield "one_in_4", torch.tensor([-3.5]), 4
    yield "constant", torch.full((100,), 0.7), 2
    yield "zeros", torch.zeros(64), 2
    # a constant of 3 has upper - lower == 0 in fp32; next to an ordinary chunk
    yield "mixed_top", torch.cat([torch.full((16,), 3.0), torch.randn(16, generator=g)]), 2
    yield "signed_zeros", torch.tensor([-0.0, 0.0, -0.0, 0.0, -0.0, -0.0]), 2
    yield "offset_1e4", 1e4 + torch.randn(512, generator=g), 2  # saturating codes
    yield "offset_1e6", 1e6 + torch.rand(512, generator=g), 1
    yield "huge_range", torch.tensor([3e38, -3e38, 1.0, 0.0, 2e38, -1e38]), 1  # overflows
    yield "big_constant", torch.full((8,), 1e30), 1  # x * scale overflows to Inf
    yield "tiny", torch.randn(256, generator=g) * 1e-30, 2
    yield "mixed_scale", torch.randn(300, generator=g) * torch.logspace(-8, 8, 300), 3
    yield "with_nan", torch.tensor([1.0, float("nan"), -2.0, 3.0, 4.0, 5.0]), 2
    yield "with_inf", torch.tensor([1.0, 2.0, float("inf"), 3.0, -4.0, 5.0]), 3
    yield "with_neg_inf", torch.tensor([float("-inf"), 2.0, 1.0, 3.0]), 1
    yield "only_nan", torch.full((9,), float("nan")), 3
    yield "halfway_codes", torch.arange(-64, 64, dtype=torch.float32) / 8, 1


def cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``dtype`` (contiguous)."""
    return values.to(dtype).contiguous()


def as_f32_numpy(tensor: torch.Tensor) -> np.ndarray:
    """Exact float32 numpy copy of a float32/float16/bfloat16 tensor."""
    return tensor.detach().cpu().float().numpy()


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of float32 arrays, except that any NaN equals any NaN."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    if a.shape != b.shape:
        return False
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return False
    return bool(np.array_equal(a[~nan_a].view(np.uint32), b[~nan_b].view(np.uint32)))


def first_difference(a: np.ndarray, b: np.ndarray) -> str:
    """A short description of where two float32 arrays first differ."""
    a = np.asarray(a, dtype=np.float32).ravel()
    b = np.asarray(b, dtype=np.float32).ravel()
    if a.shape != b.shape:
        return f"shapes {a.shape} vs {b.shape}"
    for i, (x, y) in enumerate(zip(a, b)):
        if not (np.isnan(x) and np.isnan(y)) and np.float32(x).view(np.uint32) != np.float32(
            y
        ).view(np.uint32):
            return f"index {i}: {x!r} vs {y!r}"
    return "no difference"
