"""The torch kernels against the independent numpy oracle (tests/reference), bit for bit, plus
round-trip error bounds, the non-finite policy, argument checks and two small algorithm
simulations (ByteGrad, low-precision decentralized) built from the public API."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import baguahvd.kernels as K
from baguahvd.kernels import torch_impl


def _load_cases():
    path = Path(__file__).resolve().parents[1] / "reference" / "kernel_cases.py"
    spec = importlib.util.spec_from_file_location("kernel_cases", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_cases"] = module
    spec.loader.exec_module(module)
    return module


cases = _load_cases()
oracle = cases.load_reference("minmax_uint8_oracle")

DTYPES = list(cases.DTYPES.items())
KERNEL_DTYPES = list(K.DTYPE_SUFFIXES)
CASES = list(cases.compress_cases())


def _case_ids(items):
    return [item[0] for item in items]


@pytest.mark.parametrize("dtype_name,dtype", DTYPES, ids=_case_ids(DTYPES))
@pytest.mark.parametrize("name,values,n_chunks", CASES, ids=_case_ids(CASES))
def test_compress_matches_oracle_bytes(name, values, n_chunks, dtype_name, dtype):
    x = cases.cast(values, dtype)
    buf = K.compress_minmax_uint8(x, n_chunks)
    expected = oracle.compress(cases.as_f32_numpy(x), dtype_name, n_chunks)
    got = buf.numpy()
    assert got.shape == expected.shape
    diff = np.flatnonzero(got != expected)
    assert diff.size == 0, f"{name}: first differing byte {diff[:8]}"


@pytest.mark.parametrize("dtype_name,dtype", DTYPES, ids=_case_ids(DTYPES))
@pytest.mark.parametrize("name,values,n_chunks", CASES, ids=_case_ids(CASES))
def test_decompress_matches_oracle(name, values, n_chunks, dtype_name, dtype):
    x = cases.cast(values, dtype)
    buf = K.compress_minmax_uint8(x, n_chunks)
    got = K.decompress_minmax_uint8(buf, n_chunks, x.numel(), dtype)
    assert got.dtype == dtype and got.shape == (x.numel(),)
    expected = oracle.decompress(buf.numpy(), dtype_name, x.numel(), n_chunks)
    got_np = cases.as_f32_numpy(got)
    assert cases.same_values(got_np, expected), cases.first_difference(got_np, expected)


@pytest.mark.parametrize("dtype_name,dtype", DTYPES, ids=_case_ids(DTYPES))
@pytest.mark.parametrize("n_chunks", [1, 2, 4, 7])
def test_round_trip_error_is_half_a_step(dtype_name, dtype, n_chunks):
    g = torch.Generator().manual_seed(7 + n_chunks)
    for scale in (1e-4, 1.0, 1e3):
        x = cases.cast(torch.randn(7 * 512 + 3, generator=g) * scale, dtype)
        y = K.decompress_minmax_uint8(
            K.compress_minmax_uint8(x, n_chunks), n_chunks, x.numel(), dtype
        )
        layout = K.minmax_uint8_layout(x.numel(), n_chunks)
        xf, yf = x.float(), y.float()
        for j in range(n_chunks):
            sl = slice(j * layout.chunk_size, j * layout.chunk_size + layout.chunk_valid(j))
            part = xf[sl]
            step = (part.max() - part.min() + 1e-7) / 255
            # half a quantization step, plus the final rounding to the dtype
            slack = yf[sl].abs().max() * torch.finfo(dtype).eps
            err = (yf[sl] - part).abs().max()
            assert err <= 0.5 * step * (1 + 1e-4) + slack, (j, float(err), float(step))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_non_finite_chunks_decode_to_nan_and_others_survive(dtype):
    x = torch.tensor([1.0, float("nan"), 2.0, 3.0, 4.0, 5.0, float("inf"), 7.0, 8.0], dtype=dtype)
    y = K.decompress_minmax_uint8(K.compress_minmax_uint8(x, 3), 3, 9, dtype)
    assert torch.isnan(y[0:3]).all()  # chunk 0 holds the NaN
    assert torch.isnan(y[6:9]).all()  # chunk 2 holds the Inf
    assert torch.allclose(y[3:6].float(), x[3:6].float(), atol=0.01)


def test_range_overflow_decodes_to_nan():
    x = torch.tensor([3e38, -3e38, 0.0])
    y = K.decompress_minmax_uint8(K.compress_minmax_uint8(x), 1, 3)
    assert torch.isnan(y).all()


def test_constant_chunk_decodes_to_the_constant():
    for value in (0.0, 0.7, -123.25, 1e-20):
        x = torch.full((40,), value)
        buf = K.compress_minmax_uint8(x, 2)
        codes = buf.view(2, -1)[:, 32:52]
        # One code for all: 255, or 0 once fp32 rounds upper - 255 back to upper.
        assert (codes == codes[0, 0]).all() and codes[0, 0] in (0, 255)
        y = K.decompress_minmax_uint8(buf, 2, 40)
        assert torch.allclose(y, x, rtol=1e-6, atol=1e-7)


def test_signed_zero_header_is_positive_zero():
    x = torch.tensor([-0.0, -0.0, -0.0])
    buf = K.compress_minmax_uint8(x)
    assert buf[:8].tolist() == [0] * 8


def test_layout_formula_and_padding():
    layout = K.minmax_uint8_layout(1001, 4)
    assert (layout.chunk_size, layout.slot_bytes, layout.total_bytes) == (251, 288, 1152)
    assert [layout.chunk_valid(j) for j in range(4)] == [251, 251, 251, 248]
    assert not layout.divisible
    assert K.minmax_uint8_layout(0, 3).total_bytes == 96
    assert K.minmax_uint8_layout(64, 2).slot_bytes == 64
    buf = K.compress_minmax_uint8(torch.randn(1001), 4)
    slots = buf.view(4, 288)
    assert (slots[:, 8:32] == 0).all()
    assert (slots[:, 32 + 251 :] == 0).all()
    assert (slots[3, 32 + 248 :] == 0).all()  # past the tensor's end


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_target_chunk_writes_only_its_slot(dtype):
    x = torch.randn(1000).to(dtype)
    full = K.compress_minmax_uint8(x, 4)
    slot = K.minmax_uint8_layout(1000, 4).slot_bytes
    out = torch.full_like(full, 0xAB)
    K.compress_minmax_uint8(x, 4, target_chunk=2, out=out)
    assert torch.equal(out[2 * slot : 3 * slot], full[2 * slot : 3 * slot])
    assert (out[: 2 * slot] == 0xAB).all() and (out[3 * slot :] == 0xAB).all()
    fresh = K.compress_minmax_uint8(x, 4, target_chunk=3)
    assert torch.equal(fresh[3 * slot :], full[3 * slot :]) and (fresh[: 3 * slot] == 0).all()


@pytest.mark.parametrize("dtype_name,dtype", DTYPES, ids=_case_ids(DTYPES))
@pytest.mark.parametrize("n_chunks", [1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 16, 17, 31, 33])
def test_reduce_chunks_matches_oracle(dtype_name, dtype, n_chunks):
    g = torch.Generator().manual_seed(n_chunks)
    x = (torch.randn(n_chunks * 97, generator=g) * torch.logspace(-3, 3, n_chunks * 97)).to(dtype)
    for average in (True, False):
        got = K.reduce_chunks(x, n_chunks, average=average)
        expected = oracle.reduce_chunks(cases.as_f32_numpy(x), dtype_name, n_chunks, average)
        got_np = cases.as_f32_numpy(got)
        assert cases.same_values(got_np, expected), cases.first_difference(got_np, expected)


def test_reduce_chunks_in_place_into_a_chunk():
    x = torch.randn(4 * 50)
    expected = K.reduce_chunks(x.clone(), 4)
    K.reduce_chunks(x, 4, out=x[100:150])
    assert torch.equal(x[100:150], expected)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n_chunks", [1, 3, 8])
def test_fused_decompress_reduce_equals_unfused(dtype, n_chunks):
    x = torch.randn(n_chunks * 123).to(dtype)
    buf = K.compress_minmax_uint8(x, n_chunks)
    for average in (True, False):
        fused = K.decompress_reduce_minmax_uint8(buf, n_chunks, x.numel(), dtype, average=average)
        decoded = K.decompress_minmax_uint8(buf, n_chunks, x.numel(), dtype)
        unfused = K.reduce_chunks(decoded, n_chunks, average=average)
        assert fused.dtype == dtype
        assert torch.equal(
            fused.view(torch.int16 if dtype != torch.float32 else torch.int32),
            unfused.view(torch.int16 if dtype != torch.float32 else torch.int32),
        )


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_fused_decompress_add_equals_unfused(dtype):
    x = torch.randn(777).to(dtype)
    base = torch.randn(777).to(dtype)
    buf = K.compress_minmax_uint8(x, 3)
    fused = K.decompress_add_minmax_uint8_(base.clone(), buf, 3)
    unfused = K.add_(base.clone(), K.decompress_minmax_uint8(buf, 3, 777, dtype))
    assert torch.equal(fused, unfused)


def _elementwise_inputs(dtype, n=1000, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * torch.logspace(-4, 4, n)).to(dtype) for _ in range(4)]


ELEMENTWISE = [
    ("average", K.average_, 2, ()),
    ("add", K.add_, 2, ()),
    ("subtract", K.subtract_, 2, ()),
    ("addmul", K.addmul_, 2, (-5.0 / 3.0,)),
    ("scale", K.scale_, 1, (0.1,)),
    ("divide", K.divide_, 1, (7.0,)),
    ("async", K.async_model_average_, 3, (3,)),
    ("lowprec", K.lowprec_decentralized_diff_, 4, ()),
]


@pytest.mark.parametrize("dtype_name,dtype", DTYPES, ids=_case_ids(DTYPES))
@pytest.mark.parametrize("op,fn,n_tensors,scalars", ELEMENTWISE, ids=_case_ids(ELEMENTWISE))
def test_elementwise_matches_oracle(op, fn, n_tensors, scalars, dtype_name, dtype):
    tensors = _elementwise_inputs(dtype)[:n_tensors]
    arrays = [cases.as_f32_numpy(t) for t in tensors]
    expected = oracle.elementwise(op, dtype_name, *arrays, *scalars)
    x = tensors[0].clone()
    result = fn(x, *tensors[1:], *scalars)
    assert result is x
    got = cases.as_f32_numpy(x)
    assert cases.same_values(got, expected), cases.first_difference(got, expected)


def test_lowprec_diff_is_the_spec_formula():
    x, w, left, right = _elementwise_inputs(torch.float64, n=100, seed=5)
    x, w, left, right = (t.float() for t in (x, w, left, right))
    d = K.lowprec_decentralized_diff_(x.clone(), w, left, right).double()
    spec = x.double() + left.double() / 3 + right.double() / 3 - 5 * w.double() / 3
    assert torch.allclose(d, spec, rtol=1e-5, atol=1e-3)


def test_kernels_work_on_shaped_tensors_and_return_them():
    x = torch.randn(4, 5, 6)
    buf = K.compress_minmax_uint8(x, 4)
    assert buf.shape == (K.minmax_uint8_layout(120, 4).total_bytes,)
    out = torch.empty(4, 5, 6)
    y = K.decompress_minmax_uint8(buf, 4, 120, out=out)
    assert y is out
    assert (y - x).abs().max() < 0.05
    assert K.scale_(out, 2.0) is out


def test_argument_errors_name_the_problem():
    x = torch.randn(10)
    with pytest.raises(TypeError, match="torch.float64"):
        K.compress_minmax_uint8(x.double())
    with pytest.raises(TypeError, match="torch.int32"):
        K.scale_(torch.arange(4, dtype=torch.int32), 2.0)
    with pytest.raises(ValueError, match="contiguous"):
        K.compress_minmax_uint8(torch.randn(4, 4).t())
    with pytest.raises(ValueError, match="n_chunks"):
        K.compress_minmax_uint8(x, 0)
    with pytest.raises(ValueError, match="target_chunk"):
        K.compress_minmax_uint8(x, 2, target_chunk=2)
    with pytest.raises(ValueError, match="bytes"):
        K.decompress_minmax_uint8(torch.zeros(10, dtype=torch.uint8), 1, 10)
    with pytest.raises(TypeError, match="uint8"):
        K.decompress_minmax_uint8(torch.zeros(64), 1, 10)
    with pytest.raises(ValueError, match="divisible"):
        K.reduce_chunks(x, 3)
    with pytest.raises(TypeError, match="dtype"):
        K.add_(x, x.half())
    with pytest.raises(ValueError, match="elements"):
        K.add_(x, torch.randn(11))


def test_importing_kernels_does_not_import_cupy():
    import subprocess

    code = "import sys, baguahvd.kernels; sys.exit(1 if 'cupy' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_bytegrad_simulation_is_consistent_and_close_to_the_mean():
    """Bagua's ByteGrad step (spec 1.2) for n simulated ranks, from the public kernels."""
    n, chunk = 4, 256
    g = torch.Generator().manual_seed(11)
    grads = [torch.randn(n * chunk, generator=g) for _ in range(n)]
    layout = K.minmax_uint8_layout(n * chunk, n)
    sent = [K.compress_minmax_uint8(t, n) for t in grads]
    slot = layout.slot_bytes
    reduced_bufs = []
    for r in range(n):
        # alltoall: slot j of rank r's receive buffer is rank j's compressed chunk r
        recv = torch.cat([sent[j][r * slot : (r + 1) * slot] for j in range(n)])
        mine = K.decompress_reduce_minmax_uint8(recv, n, n * chunk)
        tensor = torch.zeros(n * chunk)
        tensor[r * chunk : (r + 1) * chunk] = mine
        reduced_bufs.append(K.compress_minmax_uint8(tensor, n, target_chunk=r))
    # allgather of the reduced slots
    gathered = torch.cat([reduced_bufs[r][r * slot : (r + 1) * slot] for r in range(n)])
    result = K.decompress_minmax_uint8(gathered, n, n * chunk)
    mean = torch.stack(grads).mean(0)
    steps = []
    for j in range(n):
        sl = slice(j * chunk, (j + 1) * chunk)
        step_in = max((t[sl].max() - t[sl].min()).item() for t in grads) / 255
        step_out = (result[sl].max() - result[sl].min()).item() / 255
        steps.append(step_in + step_out)
        assert (result[sl] - mean[sl]).abs().max() <= steps[-1], j


def test_lowprec_decentralized_replicas_stay_bit_identical():
    """Spec 1.4 on a ring of 4 simulated ranks: every copy of a rank's replica stays equal."""
    n, numel = 4, 300
    g = torch.Generator().manual_seed(21)
    start = torch.randn(numel, generator=g)
    weight = [start.clone() for _ in range(n)]  # w_hat of each rank
    left = [start.clone() for _ in range(n)]  # copy of rank r-1's w_hat held by rank r
    right = [start.clone() for _ in range(n)]  # copy of rank r+1's w_hat held by rank r
    x = [start.clone() for _ in range(n)]
    for _ in range(5):
        bufs = []
        for r in range(n):
            x[r] -= 0.01 * torch.randn(numel, generator=g)  # local optimizer step
            K.lowprec_decentralized_diff_(x[r], weight[r], left[r], right[r])
            bufs.append(K.compress_minmax_uint8(x[r], 1))
        for r in range(n):
            K.decompress_add_minmax_uint8_(left[r], bufs[(r - 1) % n])
            K.decompress_add_minmax_uint8_(right[r], bufs[(r + 1) % n])
            K.decompress_add_minmax_uint8_(weight[r], bufs[r])
            x[r].copy_(weight[r])
    for r in range(n):
        assert torch.equal(left[r], weight[(r - 1) % n])
        assert torch.equal(right[r], weight[(r + 1) % n])
    assert not torch.equal(weight[0], start)


def test_torch_impl_runs_on_views_of_one_buffer():
    """decompress into a float32 out that is the whole tensor takes the no-copy path."""
    x = torch.randn(4 * 64)
    layout = K.minmax_uint8_layout(256, 4)
    buf = torch.empty(layout.total_bytes, dtype=torch.uint8)
    torch_impl.compress(x, layout, buf)
    out = torch.empty(256)
    torch_impl.decompress(buf, layout, out)
    assert np.array_equal(out.numpy(), oracle.decompress(buf.numpy(), "f32", 256, 4))


def test_kernels_accept_tensors_that_require_grad():
    w = torch.nn.Parameter(torch.randn(64))
    before = w.detach().clone()
    K.scale_(w, 2.0)
    assert torch.equal(w.detach(), before * 2) and w.requires_grad
    buf = K.compress_minmax_uint8(w, 2)
    assert not buf.requires_grad
    K.decompress_add_minmax_uint8_(w, buf, 2)


@pytest.mark.parametrize("dtype_name,dtype", DTYPES, ids=_case_ids(DTYPES))
@pytest.mark.parametrize("numel,n_chunks", [(1000, 1), (1001, 4), (4096, 8), (37, 5), (5, 8)])
def test_tiled_passes_match_oracle(monkeypatch, dtype_name, dtype, numel, n_chunks):
    """Small tiles make the fallback's column tiling split every chunk several times."""
    monkeypatch.setattr(torch_impl, "TILE_ELEMENTS", 24)
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    buf = K.compress_minmax_uint8(x, n_chunks)
    expected = oracle.compress(cases.as_f32_numpy(x), dtype_name, n_chunks)
    assert np.array_equal(buf.numpy(), expected)
    got = cases.as_f32_numpy(K.decompress_minmax_uint8(buf, n_chunks, numel, dtype))
    want = oracle.decompress(expected, dtype_name, numel, n_chunks)
    assert cases.same_values(got, want), cases.first_difference(got, want)


@pytest.mark.parametrize("dtype_name,dtype", DTYPES, ids=_case_ids(DTYPES))
@pytest.mark.parametrize("n_chunks", [1, 3, 8])
def test_tiled_decompress_reduce_matches_oracle(monkeypatch, dtype_name, dtype, n_chunks):
    monkeypatch.setattr(torch_impl, "TILE_ELEMENTS", 40)
    numel = n_chunks * 101
    x = torch.randn(numel, generator=torch.Generator().manual_seed(n_chunks)).to(dtype)
    buf = K.compress_minmax_uint8(x, n_chunks)
    decoded = oracle.decompress(buf.numpy(), dtype_name, numel, n_chunks)
    for average in (True, False):
        got = K.decompress_reduce_minmax_uint8(buf, n_chunks, numel, dtype, average=average)
        want = oracle.reduce_chunks(decoded, dtype_name, n_chunks, average)
        got_np = cases.as_f32_numpy(got)
        assert cases.same_values(got_np, want), cases.first_difference(got_np, want)
