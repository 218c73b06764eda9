"""The GPU smoke script: valid bash, and both it and its training step refuse clearly, in
one line and with a non-zero status, where there is no GPU."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_smoke.sh"
STEP = ROOT / "benchmarks" / "gpu_smoke_step.py"

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_smoke_script_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(SCRIPT, os.X_OK)


@needs_no_gpu
def test_the_smoke_script_refuses_without_a_gpu() -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_smoke.sh: no CUDA GPU is visible to torch; nothing to check"
    ]


@needs_no_gpu
def test_the_smoke_step_refuses_without_a_gpu() -> None:
    result = subprocess.run(
        [sys.executable, str(STEP)], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert result.returncode == 2
    assert "no CUDA GPU" in result.stderr and len(result.stderr.strip().splitlines()) == 1
