"""The CUDA per-element math (csrc/baguahvd_math.cuh), compiled for the host, against the
torch fallback: bit-exact for MinMaxUInt8 (fp32, fp16, bf16), the reductions, every
elementwise kernel and the fp16/bf16 conversions."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import baguahvd.kernels as K
from baguahvd.kernels.sources import source_dir

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "reference" / "kernel_host_harness.cpp"


def _load_cases():
    path = ROOT / "tests" / "reference" / "kernel_cases.py"
    spec = importlib.util.spec_from_file_location("kernel_cases", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_cases"] = module
    spec.loader.exec_module(module)
    return module


cases = _load_cases()
DTYPES = list(cases.DTYPES.items())
KERNEL_DTYPES = list(K.DTYPE_SUFFIXES)
CASES = list(cases.compress_cases())
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _ids(items):
    return [item[0] for item in items]


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    return None


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("harness") / "kernel_host_harness"
    cmd = [
        cxx,
        "-std=c++17",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-ffp-contract=off",
        f"-I{source_dir()}",
        str(HARNESS),
        "-o",
        str(exe),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return exe


class Runner:
    def __init__(self, exe: Path, tmp: Path) -> None:
        self.exe, self.tmp, self.count = exe, tmp, 0

    def path(self) -> Path:
        self.count += 1
        return self.tmp / f"f{self.count}.bin"

    def save(self, tensor: torch.Tensor) -> str:
        p = self.path()
        t = tensor.contiguous().view(-1)
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.view(torch.int16)
        t.numpy().tofile(p)
        return str(p)

    def run(self, *args: object, out_dtype: torch.dtype) -> torch.Tensor:
        out = self.path()
        cmd = [str(self.exe), *(str(a) for a in args), str(out)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        raw = np.fromfile(out, dtype=np.uint8)
        if raw.size == 0:
            return torch.empty(0, dtype=out_dtype)
        return torch.from_numpy(raw.copy()).view(out_dtype)


@pytest.fixture
def runner(harness, tmp_path) -> Runner:
    return Runner(harness, tmp_path)


def _sfx(dtype: torch.dtype) -> str:
    return K.DTYPE_SUFFIXES[dtype]


def _assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    a, b = cases.as_f32_numpy(got), cases.as_f32_numpy(expected)
    assert cases.same_values(a, b), cases.first_difference(a, b)


@pytest.mark.parametrize("dtype_name,dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name,values,n_chunks", CASES, ids=_ids(CASES))
def test_compress_and_decompress_match_torch(runner, name, values, n_chunks, dtype_name, dtype):
    x = cases.cast(values, dtype)
    numel = x.numel()
    expected = K.compress_minmax_uint8(x, n_chunks)
    got = runner.run(
        "compress", _sfx(dtype), numel, n_chunks, -1, runner.save(x), out_dtype=torch.uint8
    )
    mismatch = torch.nonzero(got != expected).flatten()
    assert mismatch.numel() == 0, f"{name}: bytes differ at {mismatch[:8].tolist()}"

    decoded = runner.run(
        "decompress", _sfx(dtype), numel, n_chunks, runner.save(expected), out_dtype=dtype
    )
    _assert_same(decoded, K.decompress_minmax_uint8(expected, n_chunks, numel, dtype))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_target_chunk_matches_torch(runner, dtype):
    x = torch.randn(1003).to(dtype)
    expected = K.compress_minmax_uint8(x, 5, target_chunk=4)
    got = runner.run("compress", _sfx(dtype), 1003, 5, 4, runner.save(x), out_dtype=torch.uint8)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n_chunks", [1, 2, 3, 5, 6, 7, 9, 12, 16, 19, 32, 45])
def test_reductions_match_torch(runner, dtype, n_chunks):
    g = torch.Generator().manual_seed(n_chunks)
    numel = n_chunks * 65
    x = (torch.randn(numel, generator=g) * torch.logspace(-4, 4, numel)).to(dtype)
    buf = K.compress_minmax_uint8(x, n_chunks)
    for average in (0, 1):
        got = runner.run(
            "reduce", _sfx(dtype), numel, n_chunks, average, runner.save(x), out_dtype=dtype
        )
        _assert_same(got, K.reduce_chunks(x, n_chunks, average=bool(average)))
        got = runner.run(
            "decompress_reduce",
            _sfx(dtype),
            numel,
            n_chunks,
            average,
            runner.save(buf),
            out_dtype=dtype,
        )
        expected = K.decompress_reduce_minmax_uint8(
            buf, n_chunks, numel, dtype, average=bool(average)
        )
        _assert_same(got, expected)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("numel,n_chunks", [(1000, 1), (1001, 4), (3, 8)])
def test_decompress_add_matches_torch(runner, dtype, numel, n_chunks):
    diff = (torch.randn(numel) * 1e-2).to(dtype)
    base = torch.randn(numel).to(dtype)
    buf = K.compress_minmax_uint8(diff, n_chunks)
    got = runner.run(
        "decompress_add",
        _sfx(dtype),
        numel,
        n_chunks,
        runner.save(buf),
        runner.save(base),
        out_dtype=dtype,
    )
    _assert_same(got, K.decompress_add_minmax_uint8_(base.clone(), buf, n_chunks))


def _inputs(dtype: torch.dtype, n: int = 2048) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(4):
        t = torch.randn(n, generator=g) * torch.logspace(-6, 6, n)
        t[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
        out.append(t.to(dtype))
    return out


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    "op,fn,n_tensors,scalar",
    [
        ("average", K.average_, 2, None),
        ("add", K.add_, 2, None),
        ("subtract", K.subtract_, 2, None),
        ("addmul", K.addmul_, 2, -0.3333333432674408),
        ("scale", K.scale_, 1, 0.10000000149011612),
        ("divide", K.divide_, 1, 7.0),
        ("async", K.async_model_average_, 3, 3.0),
        ("lowprec", K.lowprec_decentralized_diff_, 4, None),
    ],
)
def test_elementwise_matches_torch(runner, dtype, op, fn, n_tensors, scalar):
    tensors = _inputs(dtype)[:n_tensors]
    scalars = () if scalar is None else (scalar,)
    # the harness parses the scalar with strtof; these literals are exact fp32 values
    args = [op, _sfx(dtype), tensors[0].numel(), *[repr(s) for s in scalars]]
    got = runner.run(*args, *[runner.save(t) for t in tensors], out_dtype=dtype)
    expected = fn(tensors[0].clone(), *tensors[1:], *scalars)
    _assert_same(got, expected)


def _conversion_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            65504.0,
            65519.996,
            65520.0,
            65536.0,
            -65520.0,
            6.1035156e-05,
            6.0e-08,
            2.9802322e-08,
            2.98023259e-08,
            5.9604645e-08,
            8.9406967e-08,
            1e-45,
            3.4e38,
            -3.4e38,
            3.3961776e38,
            3.3961778e38,
            float("inf"),
            float("-inf"),
            1.0 + 2**-11,
            1.0 + 3 * 2**-11,
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
        ]
    )
    bits = torch.randint(0, 2**31 - 1, (20000,), generator=g, dtype=torch.int64)
    signs = torch.randint(0, 2, (20000,), generator=g, dtype=torch.int64) << 31
    raw = ((bits | signs) & 0xFFFFFFFF).to(torch.int64)
    raw = torch.where(raw >= 2**31, raw - 2**32, raw).to(torch.int32).view(torch.float32)
    raw = raw[torch.isfinite(raw)]
    # also the subnormal and overflow neighbourhoods of fp16
    near = torch.cat([torch.logspace(-9, -4, 3000), torch.linspace(60000, 70000, 3000)])
    return torch.cat([special, raw, near, -near])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrowing_conversion_matches_torch(runner, dtype):
    values = _conversion_inputs()
    got = runner.run("narrow", _sfx(dtype), values.numel(), runner.save(values), out_dtype=dtype)
    expected = values.to(dtype)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_widening_conversion_matches_torch_for_every_pattern(runner, dtype):
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    got = runner.run(
        "widen", _sfx(dtype), patterns.numel(), runner.save(patterns), out_dtype=torch.float32
    )
    _assert_same(got, patterns.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrowing_nan_stays_nan(runner, dtype):
    values = torch.tensor([float("nan"), -float("nan")])
    got = runner.run("narrow", _sfx(dtype), 2, runner.save(values), out_dtype=dtype)
    assert torch.isnan(got.float()).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_scaling_in_one_pass_keeps_the_fp32_product_bits(dtype):
    from baguahvd.kernels import torch_impl

    gen = torch.Generator().manual_seed(3)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0,
                             -65504.0, 6e-8, 1e-40])
    for exponent, factor in [(-3, 0.1), (0, -2.75), (2, 1 / 3), (4, 1e-3), (1, 3e4)]:
        x = torch.cat([torch.randn(4096, generator=gen) * 10.0**exponent, specials]).to(dtype)
        expected = (x.float() * torch.tensor(factor, dtype=torch.float32)).to(dtype)
        got = torch_impl.scale_(x.clone(), factor)
        # Every number keeps its bits; a NaN stays a NaN (its payload may differ).
        assert torch.equal(got.isnan(), expected.isnan())
        numbers = ~expected.isnan()
        assert torch.equal(got[numbers].view(torch.int16), expected[numbers].view(torch.int16))


def _minmax_values(dtype: torch.dtype, numel: int, special: float | None, at: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(numel * 31 + at)
    x = torch.randn(numel, generator=g) * 100.0
    if special is not None and numel:
        x[at % numel] = special
    elif numel:
        x[at % numel] = 1e4  # the maximum, in the scalar head, a vector or the tail
        x[(at * 7 + 3) % numel] = -1e4
    return x.to(dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    "special", [None, float("nan"), float("inf")], ids=["finite", "nan", "inf"]
)
def test_minmax_reads_every_element_once_at_any_alignment(runner, dtype, special):
    """The first min/max pass reads 16 bytes at a time from the first 16-byte boundary on;
    whatever the offset of the chunk, its length and the number of threads, the merged
    shares give the min and max of a scalar scan (and 'bad' for a NaN or an Inf)."""
    for numel, offset, workers, at in [
        (1, 0, 1, 0), (3, 1, 2, 1), (9, 1, 3, 0), (37, 3, 1, 36), (37, 5, 4, 6),
        (200, 7, 7, 199), (200, 2, 256, 2), (1031, 6, 5, 1030), (1031, 0, 3, 17),
    ]:
        x = _minmax_values(dtype, numel, special, at)
        lo, hi, bad = runner.run(
            "minmax", _sfx(dtype), numel, offset, workers, runner.save(x), out_dtype=torch.float32
        ).tolist()
        part = x[offset:].float()
        expected_bad = not bool(torch.isfinite(part).all())
        assert bool(bad) == expected_bad, (numel, offset, workers)
        if not expected_bad:
            assert (lo, hi) == (part.min().item(), part.max().item()), (numel, offset, workers)
