"""Every csrc/*.cu compiles without a warning: with nvcc for sm_80 and sm_90 (device code and
host launchers), in the kernel-only NVRTC configuration, and through NVRTC itself exactly as
the CuPy loader compiles it when libnvrtc can be found. Skipped without nvcc (NVRTC part:
without libnvrtc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from baguahvd.kernels.cuda import KERNELS
from baguahvd.kernels.layout import DTYPE_SUFFIXES
from baguahvd.kernels.sources import NVRTC_OPTIONS, SOURCE_FILES, nvrtc_source, source_dir

ARCHS = ("80", "90")
WERROR = ("--Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror")
EXPECTED_KERNELS = {f"{k}_{s}" for k in KERNELS for s in DTYPE_SUFFIXES.values()}
# The two passes that compute a chunk's min and max run inside the compress launcher.
COMPRESS_PASSES = ("minmax_uint8_partial", "minmax_uint8_header")
LAUNCHERS = {
    f"baguahvd_{k}_{s}"
    for k in KERNELS
    if k not in COMPRESS_PASSES
    for s in DTYPE_SUFFIXES.values()
} | {"baguahvd_minmax_uint8_workspace_bytes"}


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").is_file():
            return str(Path(root, "bin", "nvcc"))
    return None


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def _entries(ptx: str) -> set[str]:
    return set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))


@pytest.fixture(scope="module")
def nvcc_builds(tmp_path_factory):
    """Runs every nvcc job of this module at once (they are independent) and collects them."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("nvcc")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    jobs = {}
    for name in SOURCE_FILES:
        src = str(source_dir() / name)
        stem = Path(name).stem
        jobs[("full", name)] = (
            [NVCC, "-std=c++17", *gencode, *WERROR, "-c", src, "-o", str(out / f"{stem}.o")],
            out / f"{stem}.o",
        )
        jobs[("nvrtc", name)] = (
            [
                NVCC,
                "-std=c++17",
                "-DBAGUAHVD_NVRTC",
                f"-arch=compute_{ARCHS[0]}",
                "-ptx",
                "--Werror",
                "all-warnings",
                src,
                "-o",
                str(out / f"{stem}.ptx"),
            ],
            out / f"{stem}.ptx",
        )
    procs = {
        key: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for key, (cmd, _) in jobs.items()
    }
    results = {}
    for key, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        results[key] = (proc.returncode, log, jobs[key][1])
    return results


@needs_nvcc
@pytest.mark.parametrize("name", SOURCE_FILES)
def test_nvcc_sm80_sm90_without_warnings(nvcc_builds, name):
    rc, log, obj = nvcc_builds[("full", name)]
    assert rc == 0, log
    assert "warning" not in log.lower(), log
    assert obj.is_file()


@needs_nvcc
@pytest.mark.parametrize("name", SOURCE_FILES)
def test_nvcc_kernel_only_configuration(nvcc_builds, name):
    rc, log, ptx = nvcc_builds[("nvrtc", name)]
    assert rc == 0, log
    assert "warning" not in log.lower(), log
    assert _entries(ptx.read_text())


@needs_nvcc
def test_every_loader_kernel_is_defined(nvcc_builds):
    found: set[str] = set()
    for name in SOURCE_FILES:
        found |= _entries(nvcc_builds[("nvrtc", name)][2].read_text())
    assert found == EXPECTED_KERNELS


@needs_nvcc
def test_host_launchers_are_exported(nvcc_builds):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    symbols: set[str] = set()
    for name in SOURCE_FILES:
        obj = nvcc_builds[("full", name)][2]
        listing = subprocess.run(
            [nm, "-g", "--defined-only", str(obj)], capture_output=True, text=True, check=True
        ).stdout
        symbols |= {line.split()[-1] for line in listing.splitlines() if line.strip()}
    assert LAUNCHERS <= symbols, sorted(LAUNCHERS - symbols)


def _find_nvrtc() -> str | None:
    candidates = []
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")))
    for entry in sys.path:
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libnvrtc.so*")))
    for path in candidates:
        if "builtins" in os.path.basename(path):
            continue
        try:
            ctypes.CDLL(path)
        except OSError:
            continue
        return path
    return None


def _nvrtc_compile(lib: ctypes.CDLL, source: str, options: list[str]) -> tuple[int, str, str]:
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(
        ctypes.byref(prog), source.encode(), b"baguahvd_kernels.cu", 0, None, None
    )
    assert rc == 0, f"nvrtcCreateProgram failed with {rc}"
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx = ""
        if rc == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buf)
            ptx = buf.value.decode()
        return rc, log.value.decode(errors="replace").strip(), ptx
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compiles_the_loader_source_without_warnings(arch):
    path = _find_nvrtc()
    if path is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc to run this check)")
    lib = ctypes.CDLL(path)
    rc, log, ptx = _nvrtc_compile(lib, nvrtc_source(), [*NVRTC_OPTIONS, f"-arch=compute_{arch}"])
    assert rc == 0, log
    assert log == "", log
    assert _entries(ptx) == EXPECTED_KERNELS


def test_nvrtc_source_inlines_the_header_once():
    src = nvrtc_source()
    assert '#include "baguahvd_math.cuh"' not in src
    assert src.count("namespace bhvd {") >= 3
    assert src.count("struct QuantParams {") == 1
    assert "#pragma once" not in src


def _kernel_ptx(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    following = ptx.find(".entry ", start + 1)
    return ptx[start:] if following < 0 else ptx[start:following]


@needs_nvcc
@pytest.mark.parametrize("suffix", sorted(DTYPE_SUFFIXES.values()))
def test_minmax_first_pass_reads_16_bytes_at_a_time(nvcc_builds, suffix):
    ptx = nvcc_builds[("nvrtc", "minmax_uint8.cu")][2].read_text()
    body = _kernel_ptx(ptx, f"minmax_uint8_partial_{suffix}")
    assert re.search(r"ld\.global\.nc\.v4\.u32", body), "no 128-bit load in the min/max pass"


@needs_nvcc
@pytest.mark.parametrize("kernel", ["decompress", "decompress_add", "decompress_reduce"])
def test_decompress_kernels_share_the_chunk_parameters_per_block(nvcc_builds, kernel):
    ptx = nvcc_builds[("nvrtc", "minmax_uint8.cu")][2].read_text()
    for suffix in DTYPE_SUFFIXES.values():
        body = _kernel_ptx(ptx, f"{kernel}_minmax_uint8_{suffix}")
        assert "st.shared" in body and "bar.sync" in body, f"{kernel}_{suffix}"
