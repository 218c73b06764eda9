"""The CUDA kernels (compiled by the CuPy loader) against the torch fallback run on the CPU:
bit-exact buffers and values for every kernel and dtype. Needs a GPU and CuPy."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import baguahvd.kernels as K
from baguahvd.kernels import torch_impl

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("needs CuPy", allow_module_level=True)


def _load_cases():
    path = Path(__file__).resolve().parents[1] / "reference" / "kernel_cases.py"
    spec = importlib.util.spec_from_file_location("kernel_cases", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_cases"] = module
    spec.loader.exec_module(module)
    return module


cases = _load_cases()
DTYPES = list(cases.DTYPES.items())
KERNEL_DTYPES = list(K.DTYPE_SUFFIXES)
CASES = [
    *cases.compress_cases(),
    ("large_1", torch.randn(3_000_001, generator=torch.Generator().manual_seed(1)), 1),
    ("large_7", torch.randn(1_000_003, generator=torch.Generator().manual_seed(2)) * 1e-3, 7),
    ("many_chunks", torch.randn(70_000, generator=torch.Generator().manual_seed(3)), 700),
]


def _ids(items):
    return [item[0] for item in items]


def _assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    a, b = cases.as_f32_numpy(got), cases.as_f32_numpy(expected)
    assert cases.same_values(a, b), cases.first_difference(a, b)


def test_loader_finds_cupy():
    assert K.cuda_kernels_available()


@pytest.mark.parametrize("dtype_name,dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name,values,n_chunks", CASES, ids=_ids(CASES))
def test_compress_decompress_match_torch(name, values, n_chunks, dtype_name, dtype):
    x = cases.cast(values, dtype)
    layout = K.minmax_uint8_layout(x.numel(), n_chunks)
    expected = torch.empty(layout.total_bytes, dtype=torch.uint8)
    torch_impl.compress(x, layout, expected)
    got = K.compress_minmax_uint8(x.cuda(), n_chunks)
    assert got.is_cuda
    mismatch = torch.nonzero(got.cpu() != expected).flatten()
    assert mismatch.numel() == 0, f"{name}: bytes differ at {mismatch[:8].tolist()}"

    decoded = K.decompress_minmax_uint8(got, n_chunks, x.numel(), dtype)
    reference = torch_impl.decompress(expected, layout, torch.empty(x.numel(), dtype=dtype))
    _assert_same(decoded.cpu(), reference)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_target_chunk_and_fused_ops_match_torch(dtype):
    n, chunk = 6, 50_001
    x = (torch.randn(n * chunk) * 1e-2).to(dtype)
    layout = K.minmax_uint8_layout(x.numel(), n)
    ref = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    torch_impl.compress(x, layout, ref, target_chunk=4)
    got = K.compress_minmax_uint8(x.cuda(), n, target_chunk=4)
    assert torch.equal(got.cpu(), ref)

    buf = K.compress_minmax_uint8(x, n)
    for average in (True, False):
        got = K.decompress_reduce_minmax_uint8(buf.cuda(), n, x.numel(), dtype, average=average)
        _assert_same(
            got.cpu(), K.decompress_reduce_minmax_uint8(buf, n, x.numel(), dtype, average=average)
        )
        got = K.reduce_chunks(x.cuda(), n, average=average)
        _assert_same(got.cpu(), K.reduce_chunks(x, n, average=average))

    base = torch.randn(x.numel()).to(dtype)
    got = K.decompress_add_minmax_uint8_(base.cuda(), buf.cuda(), n)
    _assert_same(got.cpu(), K.decompress_add_minmax_uint8_(base.clone(), buf, n))

    inplace = x.cuda()
    K.reduce_chunks(inplace, n, out=inplace[2 * chunk : 3 * chunk])
    _assert_same(inplace[2 * chunk : 3 * chunk].cpu(), K.reduce_chunks(x, n))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    "fn,n_tensors,scalars",
    [
        (K.average_, 2, ()),
        (K.add_, 2, ()),
        (K.subtract_, 2, ()),
        (K.addmul_, 2, (-5.0 / 3.0,)),
        (K.scale_, 1, (0.1,)),
        (K.divide_, 1, (7.0,)),
        (K.async_model_average_, 3, (3,)),
        (K.lowprec_decentralized_diff_, 4, ()),
    ],
)
def test_elementwise_match_torch(dtype, fn, n_tensors, scalars):
    g = torch.Generator().manual_seed(4)
    tensors = [(torch.randn(1_000_000, generator=g) * 100).to(dtype) for _ in range(n_tensors)]
    expected = fn(tensors[0].clone(), *tensors[1:], *scalars)
    got = fn(*[t.cuda() for t in tensors], *scalars)
    _assert_same(got.cpu(), expected)


def test_kernels_run_on_the_current_stream():
    x = torch.randn(4_000_000, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        buf = K.compress_minmax_uint8(x, 4)
        y = K.decompress_minmax_uint8(buf, 4, x.numel())
        K.scale_(y, 2.0)
    stream.synchronize()
    expected = K.scale_(
        K.decompress_minmax_uint8(K.compress_minmax_uint8(x.cpu(), 4), 4, x.numel()), 2.0
    )
    _assert_same(y.cpu(), expected)
