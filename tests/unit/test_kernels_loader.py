"""The CuPy loader's bookkeeping, checked against a fake CuPy: one compile per device with the
packaged source, and every launch passing exactly the argument types, buffer sizes and grid
shapes that the kernel's C signature (parsed from the preprocessed source) expects."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import baguahvd.kernels as K
from baguahvd.kernels import cuda as cuda_mod
from baguahvd.kernels.sources import NVRTC_OPTIONS, nvrtc_source
from tests.fakes.fake_cupy import stream_protocol_handle

KERNEL_DTYPES = list(K.DTYPE_SUFFIXES)

pytestmark = pytest.mark.bookkeeping

_SIGNATURE = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+__launch_bounds__\(([^)]*)\)\s*(\w+)\s*\(([^)]*)\)'
)


def _param_kind(param: str) -> str:
    param = " ".join(param.split())
    if "*" in param:
        if "unsigned char" in param:
            return "u8*"
        if "storage" in param:
            return "storage*"
        if param.startswith("float") or param.startswith("const float"):
            return "f32*"
        raise AssertionError(param)
    if param.startswith("long long"):
        return "i64"
    if param.startswith("int"):
        return "i32"
    if param.startswith("float"):
        return "f32"
    raise AssertionError(param)


@pytest.fixture(scope="module")
def signatures() -> dict[str, tuple[str, list[str]]]:
    cpp = shutil.which("cpp") or shutil.which("g++")
    if cpp is None:
        pytest.skip("no C preprocessor")
    cmd = [cpp, "-E", "-P", "-DBAGUAHVD_NVRTC", "-D__CUDACC_RTC__", "-x", "c++", "-"]
    if cpp.endswith("cpp"):
        cmd = [cpp, "-P", "-DBAGUAHVD_NVRTC", "-D__CUDACC_RTC__", "-x", "c++", "-"]
    text = subprocess.run(
        cmd, input=nvrtc_source(), capture_output=True, text=True, check=True
    ).stdout
    found = {}
    for bounds, name, params in _SIGNATURE.findall(text):
        found[name] = (bounds.strip(), [_param_kind(p) for p in params.split(",")])
    assert len(found) == len(K.DTYPE_SUFFIXES) * len(cuda_mod.KERNELS)
    return found


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[object, ...]]] = []
        self.modules: list[SimpleNamespace] = []


def _fake_cupy(rec: _Recorder) -> SimpleNamespace:
    class FakeArray:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    class FakeModule:
        def __init__(self, code: str, options: tuple[str, ...]) -> None:
            self.code, self.options, self.compiled = code, options, 0
            rec.modules.append(self)

        def compile(self) -> None:
            self.compiled += 1

        def get_function(self, name: str):
            def launch(grid, block, args):
                rec.calls.append((name, grid, block, args))

            return launch

    @contextlib.contextmanager
    def device(index):
        yield

    @contextlib.contextmanager
    def external_stream(ptr, device_id):
        assert ptr == 1234
        yield

    return SimpleNamespace(
        RawModule=FakeModule,
        from_dlpack=FakeArray,
        cuda=SimpleNamespace(
            Device=device, ExternalStream=external_stream, Stream=SimpleNamespace()
        ),
        FakeArray=FakeArray,
    )


@pytest.fixture
def fake(monkeypatch):
    rec = _Recorder()
    cupy = _fake_cupy(rec)
    monkeypatch.setattr(cuda_mod, "_import_cupy", lambda: cupy)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=1234)
    )
    loader = cuda_mod.CudaKernelLoader()
    kernels = loader.kernels_for(torch.device("cuda", 0))
    return SimpleNamespace(rec=rec, cupy=cupy, loader=loader, kernels=kernels)


_STORAGE_BYTES = {suffix: dtype.itemsize for dtype, suffix in K.DTYPE_SUFFIXES.items()}


def _check_calls(rec: _Recorder, signatures, cupy) -> None:
    assert rec.calls
    for name, grid, block, args in rec.calls:
        bounds, kinds = signatures[name]
        assert block == ((32,) if bounds.endswith("kHeaderThreads") else (256,)), name
        assert 1 <= grid[0] <= 2**31 - 1 and all(1 <= g <= 65535 for g in grid[1:]), name
        assert len(args) == len(kinds), (name, len(args), kinds)
        sfx = name.rsplit("_", 1)[1]
        for arg, kind in zip(args, kinds):
            if kind.endswith("*"):
                assert isinstance(arg, cupy.FakeArray), (name, kind, arg)
                t = arg.tensor
                assert t.is_contiguous()
                if kind == "u8*":
                    assert t.dtype == torch.uint8, name
                elif kind == "f32*":
                    assert t.dtype == torch.float32, name
                else:
                    assert t.element_size() == _STORAGE_BYTES[sfx], name
                    assert t.dtype in (torch.float32, torch.int16), name
            else:
                expected = {"i64": np.int64, "i32": np.int32, "f32": np.float32}[kind]
                assert type(arg) is expected, (name, kind, type(arg))


def test_one_compile_per_device_with_the_packaged_source(fake):
    assert len(fake.rec.modules) == 1
    module = fake.rec.modules[0]
    assert module.code == nvrtc_source()
    assert module.options == NVRTC_OPTIONS
    assert module.compiled == 1
    assert fake.loader.kernels_for(torch.device("cuda", 0)) is fake.kernels
    assert len(fake.rec.modules) == 1
    fake.loader.kernels_for(torch.device("cuda", 1))
    assert len(fake.rec.modules) == 2


def test_missing_cupy_is_reported_once_and_gives_none(monkeypatch, caplog):
    monkeypatch.setattr(cuda_mod, "_import_cupy", lambda: None)
    loader = cuda_mod.CudaKernelLoader()
    with caplog.at_level(logging.WARNING, logger=cuda_mod.__name__):
        assert loader.kernels_for(torch.device("cuda", 0)) is None
        assert loader.kernels_for(torch.device("cuda", 0)) is None
        assert not loader.available()
    assert sum("CuPy is not installed" in r.message for r in caplog.records) == 1


def test_kernels_use_stream_from_external_where_cupy_has_it(fake, monkeypatch):
    # CuPy 14: the stream travels through the CUDA stream protocol, as the real
    # Stream.from_external(obj) wants it (tests/unit/test_cupy_conformance.py checks it there).
    used: list[int] = []

    @contextlib.contextmanager
    def from_external(obj):
        used.append(stream_protocol_handle(obj))
        yield

    def deprecated(ptr, device_id):
        raise AssertionError("cupy.cuda.ExternalStream is deprecated in CuPy 14")

    monkeypatch.setattr(fake.cupy.cuda, "Stream", SimpleNamespace(from_external=from_external))
    monkeypatch.setattr(fake.cupy.cuda, "ExternalStream", deprecated)
    fake.kernels.elementwise("scale_inplace", [torch.ones(8)], [2.0])
    assert used == [1234]


def test_a_failed_compile_falls_back_to_torch_with_one_warning(monkeypatch, caplog):
    rec = _Recorder()
    cupy = _fake_cupy(rec)

    def broken_compile(self) -> None:
        raise RuntimeError("nvrtc: libnvrtc.so.12 not found")

    monkeypatch.setattr(cupy.RawModule, "compile", broken_compile)
    monkeypatch.setattr(cuda_mod, "_import_cupy", lambda: cupy)
    loader = cuda_mod.CudaKernelLoader()
    with caplog.at_level(logging.WARNING, logger=cuda_mod.__name__):
        assert loader.kernels_for(torch.device("cuda", 0)) is None
        assert loader.kernels_for(torch.device("cuda", 0)) is None
    warnings = [r.message for r in caplog.records if "compiling" in r.message]
    assert len(warnings) == 1
    assert "libnvrtc" in warnings[0] and "nvidia-cuda-nvrtc-cu12" in warnings[0]
    assert len(rec.modules) == 1


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    "numel,n_chunks,target",
    [(1000, 4, None), (1001, 4, 3), (0, 2, None), (5, 8, None), (300_000, 1, None)],
)
def test_compress_launches_match_the_signatures(fake, signatures, dtype, numel, n_chunks, target):
    x = torch.zeros(numel, dtype=dtype)
    layout = K.minmax_uint8_layout(numel, n_chunks)
    out = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fake.kernels.compress(x, layout, out, target)
    sfx = K.DTYPE_SUFFIXES[dtype]
    names = [c[0] for c in fake.rec.calls]
    assert names == [
        f"minmax_uint8_partial_{sfx}",
        f"minmax_uint8_header_{sfx}",
        f"compress_minmax_uint8_{sfx}",
    ]
    _check_calls(fake.rec, signatures, fake.cupy)
    partial, header, codes = fake.rec.calls
    rows = n_chunks if target is None else 1
    assert partial[1][1] == header[1][0] == codes[1][1] == rows
    workspace = partial[3][4].tensor
    assert workspace.numel() >= 2 * partial[1][0] * partial[1][1]
    assert int(header[3][1]) == partial[1][0]  # blocks_per_chunk matches the first pass grid
    assert int(codes[3][3]) == (0 if target is None else target)
    assert int(codes[3][5]) == layout.slot_bytes


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_other_launches_match_the_signatures(fake, signatures, dtype):
    n, chunk = 3, 100
    x = torch.zeros(n * chunk, dtype=dtype)
    layout = K.minmax_uint8_layout(n * chunk, n)
    buf = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    out = torch.zeros(chunk, dtype=dtype)
    k = fake.kernels
    k.decompress(buf, layout, x)
    k.decompress_add_(x, buf, layout)
    k.decompress_reduce(buf, layout, out, True)
    k.reduce_chunks(x, n, out, False)
    k.elementwise("average_inplace", [x, x])
    k.elementwise("add_inplace", [x, x])
    k.elementwise("subtract_inplace", [x, x])
    k.elementwise("addmul_inplace", [x, x], [0.5])
    k.elementwise("scale_inplace", [x], [0.5])
    k.elementwise("divide_inplace", [x], [3.0])
    k.elementwise("async_model_average", [x, x, x], [4.0])
    k.elementwise("lowprec_decentralized_diff", [x, x, x, x])
    _check_calls(fake.rec, signatures, fake.cupy)
    assert len(fake.rec.calls) == 12


def test_every_public_elementwise_op_has_a_kernel(signatures):
    from baguahvd.kernels import ops

    for op in ops._TORCH_OPS:
        for sfx in K.DTYPE_SUFFIXES.values():
            assert f"{op}_{sfx}" in signatures


def test_empty_tensors_launch_nothing(fake):
    x = torch.zeros(0)
    layout = K.minmax_uint8_layout(0, 2)
    fake.kernels.decompress(torch.zeros(layout.total_bytes, dtype=torch.uint8), layout, x)
    fake.kernels.elementwise("scale_inplace", [x], [2.0])
    assert fake.rec.calls == []


def test_the_minmax_first_pass_fills_the_device_when_its_sm_count_is_known():
    from baguahvd.kernels import cuda as kcuda

    big = 1 << 26  # needs far more than 128 blocks of 256 x 16 elements
    assert kcuda.minmax_blocks_per_chunk(big) == kcuda.MAX_MINMAX_BLOCKS
    assert kcuda.minmax_blocks_per_chunk(big, rows=1, sm_count=132) == 132 * 8
    assert kcuda.minmax_blocks_per_chunk(big, rows=4, sm_count=132) == 132 * 2
    # Many chunks fill the device by themselves: the per-chunk floor stays.
    assert kcuda.minmax_blocks_per_chunk(big, rows=64, sm_count=132) == kcuda.MAX_MINMAX_BLOCKS
    # Never more blocks than the chunk has work for.
    assert kcuda.minmax_blocks_per_chunk(4096 * 3, rows=1, sm_count=132) == 3
