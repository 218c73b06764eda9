"""Static checks run as part of the suite: ruff on everything, mypy on the package, the
import-linter contracts and module sizes."""

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


def test_import_layers() -> None:
    """The import-linter contracts in pyproject.toml: the layer order of the README's
    Architecture section, and no import cycle between the modules of any package."""
    result = subprocess.run(
        [_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_module_sizes() -> None:
    """No module of the package grows past 600 lines, and none of the engine past 400,
    except torch/mpi_ops.py, which keeps the shape of Horovod's file of the same name so that
    the two can be read side by side."""
    too_long = {
        str(relative): lines
        for path in sorted((ROOT / "baguahvd").rglob("*.py"))
        if (relative := path.relative_to(ROOT)).as_posix() != "baguahvd/torch/mpi_ops.py"
        and (lines := len(path.read_text().splitlines()))
        > (400 if relative.parts[:2] == ("baguahvd", "engine") else 600)
    }
    assert not too_long, too_long
