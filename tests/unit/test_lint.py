"""Static checks run as part of the suite: ruff on everything, mypy on the package."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    beside = pathlib.Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


def test_ruff() -> None:
    result = subprocess.run(
        [_tool("ruff"), "check", "baguahvd", "tests", "benchmarks", "examples"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy() -> None:
    result = subprocess.run(
        [_tool("mypy"), "--no-error-summary"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
