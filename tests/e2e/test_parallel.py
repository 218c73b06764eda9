"""Launches every ``tests/parallel/test_*.py`` under ``mpirun -np 2`` and ``-np 3``, and the
modules in :data:`ALSO_AT_4` under ``-np 4`` too.

Each rank runs the same pytest session; the launch fails if any rank fails, hangs past the
timeout, or dies, and the failure message carries every rank's output.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from tests.support import jobs

PARALLEL = sorted(p.name for p in (jobs.ROOT / "tests" / "parallel").glob("test_*.py"))
TIMEOUT_S = int(os.environ.get("BAGUAHVD_TEST_TIMEOUT", "300"))
ALSO_AT_4 = ("test_join_uneven.py",)
"""Modules whose logic depends on the world size beyond two and three ranks (how many ranks
joined before the others)."""
SPLIT_DATA_PLANE = (
    "test_allreduce.py", "test_allgather_broadcast.py", "test_alltoall_reducescatter.py",
    "test_process_sets.py", "test_algo_centralized.py", "test_algo_async.py",
    "test_algo_adasum.py", "test_lifecycle.py", "test_data_plane.py",
)
"""Modules also run with BAGUAHVD_CPU_BACKEND=gloo: MPI negotiates, gloo moves the CPU
tensors (the data plane auto picks between hosts over TCP), at -np 2."""
ALSO_AT_5_AND_6 = ("test_scaling.py",)
"""Modules whose arithmetic depends on sizes whose inverse is not exact in binary."""
RUNS = [(module, np) for module in PARALLEL for np in (2, 3)] + [
    (module, 4) for module in ALSO_AT_4
] + [(module, np) for module in ALSO_AT_5_AND_6 for np in (5, 6)]
MODULE_ENV = {"test_call_sites.py": {"BAGUAHVD_CHECK_CALL_SITES": "1"}}
"""Settings read at init() that a module needs (the module skips itself without them)."""


@pytest.mark.parallel
@pytest.mark.parametrize(("module", "np"), RUNS)
def test_parallel(module: str, np: int, tmp_path: pathlib.Path) -> None:
    result = jobs.launch(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--timeout", "120",
         f"tests/parallel/{module}"],
        np,
        tmp_path,
        TIMEOUT_S,
        extra_env={jobs.PARALLEL_WORKER_ENV: "1", **MODULE_ENV.get(module, {})},
    )
    if result.returncode != 0:
        pytest.fail(
            f"{module} failed at -np {np} (exit {result.returncode})\n{result.stderr}\n"
            f"{result.stdout}",
            pytrace=False,
        )


@pytest.mark.parallel
@pytest.mark.parametrize("module", SPLIT_DATA_PLANE)
def test_parallel_gloo_data_plane(module: str, tmp_path: pathlib.Path) -> None:
    result = jobs.launch(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--timeout", "120",
         f"tests/parallel/{module}"],
        2,
        tmp_path,
        TIMEOUT_S,
        extra_env={jobs.PARALLEL_WORKER_ENV: "1", "BAGUAHVD_CPU_BACKEND": "gloo"},
    )
    if result.returncode != 0:
        pytest.fail(
            f"{module} failed with BAGUAHVD_CPU_BACKEND=gloo (exit {result.returncode})\n"
            f"{result.stderr}\n{result.stdout}",
            pytrace=False,
        )
