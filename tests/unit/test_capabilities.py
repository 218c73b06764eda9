"""Build-capability queries (Horovod's ``*_built()``), answered for this environment."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from baguahvd.common import capabilities

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_answers() -> Iterator[None]:
    capabilities.nccl_built.cache_clear()
    capabilities.cuda_built.cache_clear()
    yield
    capabilities.nccl_built.cache_clear()
    capabilities.cuda_built.cache_clear()


def test_answers_here() -> None:
    assert capabilities.mpi_built() is True
    assert capabilities.gloo_built() is True  # torch.distributed with gloo
    assert capabilities.ddl_built() is False
    assert capabilities.ccl_built() is False
    assert capabilities.rocm_built() is False


def test_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whether or not CuPy is installed here, the answers for a machine without it.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *args: None if name.split(".")[0] == "cupy" else find_spec(name, *args),
    )
    nccl = capabilities.nccl_built()
    assert type(nccl) is int
    assert nccl == 0
    assert capabilities.cuda_built() is False


def test_import_loads_neither_cupy_nor_mpi4py() -> None:
    check = (
        "import sys, baguahvd.common.capabilities as c; c.mpi_built(); "
        "assert not {'cupy', 'mpi4py'} & set(sys.modules), sorted(sys.modules)"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=60)


def _fake_cupy(root: Path, nccl_body: str, runtime_body: str) -> None:
    package = root / "cupy"
    (package / "cuda").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import cuda\n")
    (package / "cuda" / "__init__.py").write_text("from . import runtime\n")
    (package / "cuda" / "nccl.py").write_text(nccl_body)
    (package / "cuda" / "runtime.py").write_text(runtime_body)


@pytest.fixture
def fake_cupy_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    # A real CuPy imported by an earlier test stays out of the way until this one is done.
    for name in [name for name in sys.modules if name == "cupy" or name.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [name for name in sys.modules if name == "cupy" or name.startswith("cupy.")]:
        del sys.modules[name]


def test_versions_come_from_cupy(fake_cupy_root: Path) -> None:
    _fake_cupy(
        fake_cupy_root,
        "def get_version():\n    return 21805\n",
        "def runtimeGetVersion():\n    return 12040\n",
    )
    assert capabilities.nccl_built() == 21805
    assert capabilities.cuda_built() is True


def test_broken_cupy_means_not_built(fake_cupy_root: Path) -> None:
    _fake_cupy(
        fake_cupy_root,
        "def get_version():\n    raise RuntimeError('libnccl.so.2: cannot open')\n",
        "def runtimeGetVersion():\n    raise OSError('libcudart.so: cannot open')\n",
    )
    assert capabilities.nccl_built() == 0
    assert capabilities.cuda_built() is False


def test_answer_is_cached(fake_cupy_root: Path) -> None:
    _fake_cupy(
        fake_cupy_root,
        "calls = []\ndef get_version():\n    calls.append(1)\n    return 2708\n",
        "def runtimeGetVersion():\n    return 0\n",
    )
    assert capabilities.nccl_built() == 2708
    assert capabilities.nccl_built() == 2708
    assert sys.modules["cupy.cuda.nccl"].calls == [1]
    assert capabilities.cuda_built() is False
