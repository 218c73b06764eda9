"""Part 1 of ``benchmarks/gpu_check.py``: what the check runs on. Python, torch, CUDA, CuPy,
NCCL (as CuPy loads it, ``cupy.cuda.nccl.get_version()``, and as torch was built with),
NVRTC, the GPU, the driver, the installed distributions, and which baguahvd is imported (it
must be this tree's: the check runs it from ``PYTHONPATH``, never installs it).

Runs as a plain process::

    python benchmarks/gpu_check_env.py --part versions --result out.json
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import platform
import shutil
import subprocess
import sys

import torch
from gpu_check_common import (
    CheckFailed,
    Recorder,
    WorkerArgs,
    needs_cuda,
    require,
    run_worker,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
DISTRIBUTIONS = (
    "torch", "numpy", "cupy-cuda13x", "cupy-cuda12x", "nvidia-nccl-cu13", "nvidia-nccl-cu12",
    "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12", "mpi4py", "pytest", "pytest-timeout",
    "lightning",
)


def nccl_version_text(code: int) -> str:
    """NCCL's version code as text: 22703 -> 2.27.3 (codes before 2.9 had two digits less)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def versions(rec: Recorder, args: WorkerArgs) -> None:
    device = args.device
    data = rec.data
    data["python"] = f"{platform.python_version()} ({sys.executable})"
    data["platform"] = platform.platform()
    data["torch"] = torch.__version__
    data["torch_cuda"] = torch.version.cuda
    installed = {}
    for name in DISTRIBUTIONS:
        try:
            installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    data["distributions"] = installed

    def gpu() -> str:
        needs_cuda(device)
        props = torch.cuda.get_device_properties(device)
        data["gpu"] = props.name
        data["gpu_count"] = torch.cuda.device_count()
        data["gpu_capability"] = f"{props.major}.{props.minor}"
        data["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        data["gpu_sms"] = props.multi_processor_count
        built = torch.cuda.nccl.version()
        data["torch_nccl"] = ".".join(map(str, built)) if isinstance(built, tuple) else built
        return f"{props.name} (sm_{props.major}{props.minor}), {data['gpu_count']} visible"

    rec.check("torch_gpu", gpu)

    def driver() -> str:
        needs_cuda(device)
        smi = shutil.which("nvidia-smi")
        if smi is None:
            raise CheckFailed("nvidia-smi is not on PATH")
        query = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )
        require(query.returncode == 0, f"nvidia-smi failed: {query.stderr.strip()}")
        data["nvidia_smi"] = query.stdout.strip()
        return data["nvidia_smi"]

    rec.check("driver", driver)

    def cupy() -> str:
        needs_cuda(device)
        import cupy as cp
        import cupy.cuda.nccl

        data["cupy"] = cp.__version__
        data["cuda_runtime"] = int(cp.cuda.runtime.runtimeGetVersion())
        data["cuda_driver"] = int(cp.cuda.runtime.driverGetVersion())
        code = int(cupy.cuda.nccl.get_version())
        data["nccl"] = f"{nccl_version_text(code)} ({code})"
        return (f"CuPy {cp.__version__}, CUDA runtime {data['cuda_runtime']}, driver API "
                f"{data['cuda_driver']}, NCCL {data['nccl']}")

    rec.check("cupy_nccl", cupy)

    def nvrtc() -> str:
        needs_cuda(device)
        import cupy as cp

        # An attribute of cupy.cuda, not an importable submodule.
        data["nvrtc"] = ".".join(str(v) for v in cp.cuda.nvrtc.getVersion())
        return f"NVRTC {data['nvrtc']} (compiles baguahvd's kernels)"

    rec.check("nvrtc", nvrtc)

    def this_tree() -> str:
        import baguahvd
        import baguahvd.torch as hvd

        location = pathlib.Path(baguahvd.__file__).resolve()
        data["baguahvd"] = str(location.parent)
        require(ROOT in location.parents,
                f"baguahvd is imported from {location.parent}, not from this tree ({ROOT})")
        data["nccl_built"] = hvd.nccl_built()
        data["cuda_built"] = hvd.cuda_built()
        data["gloo_built"] = hvd.gloo_built()
        return f"from {location.parent}; hvd.nccl_built() = {data['nccl_built']}"

    rec.check("baguahvd_from_this_tree", this_tree)

    def nccl_built() -> str:
        needs_cuda(device)
        require(bool(data.get("nccl_built")), "hvd.nccl_built() is 0: CUDA tensors cannot "
                                              "reach NCCL")
        return str(data["nccl_built"])

    rec.check("hvd_nccl_built", nccl_built)

    def commit() -> str:
        git = shutil.which("git")
        if git is None or not (ROOT / ".git").exists():
            return "no git checkout here"
        head = subprocess.run([git, "-C", str(ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=30)
        data["commit"] = head.stdout.strip() or None
        if data["commit"] is None:
            return head.stderr.strip()
        # A copied tree may come with an older .git: say whether the files are HEAD's.
        status = subprocess.run([git, "-C", str(ROOT), "status", "--porcelain",
                                 "--untracked-files=no"],
                                capture_output=True, text=True, timeout=60)
        changed = [line[3:] for line in status.stdout.splitlines() if line.strip()]
        data["changed_since_commit"] = changed
        if changed:
            return f"{data['commit']} with {len(changed)} tracked files changed since"
        return data["commit"]

    rec.check("commit", commit)


if __name__ == "__main__":
    sys.exit(run_worker({"versions": versions}, engine=False))
