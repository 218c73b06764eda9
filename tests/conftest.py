"""Test-suite layout: ``tests/unit`` runs in this process; ``tests/parallel`` bodies run on
every rank under mpirun and are launched by ``tests/e2e/test_parallel.py``; the other
``tests/e2e`` suites launch whole scripts and ``baguahvdrun`` jobs; ``tests/support`` holds
what they share (launching jobs, the library tables tests parametrize over)."""

from __future__ import annotations

import os
import pathlib

import pytest

from tests.support.jobs import PARALLEL_WORKER_ENV

PARALLEL_DIR = pathlib.Path(__file__).resolve().parent / "parallel"

_JOB_ENV = (PARALLEL_WORKER_ENV, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE")
"""Set in a process that a launcher started as one rank of a job: the launched-test flag,
Open MPI's and MPICH's world size, torchrun's."""

NOT_IN_A_JOB = (
    "tests/parallel runs on every rank of a job: run it with "
    "`mpirun -np 2 python -m pytest tests/parallel/<module>`, or through "
    "`pytest tests/e2e/test_parallel.py -k <module>`"
)


def _in_a_job() -> bool:
    return any(os.environ.get(name) for name in _JOB_ENV)


def _names_parallel(config: pytest.Config) -> bool:
    """Whether the command line names ``tests/parallel`` or something inside it."""
    for arg in config.args:
        path = pathlib.Path(str(arg).split("::", 1)[0]).resolve()
        if path == PARALLEL_DIR or PARALLEL_DIR in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    # The bodies are collected by the ranks of a job, and where a command names them (they
    # then skip, saying how to run them); a run of the whole suite passes them over, since
    # tests/e2e/test_parallel.py launches them.
    if collection_path.resolve() != PARALLEL_DIR:
        return None
    return None if _in_a_job() or _names_parallel(config) else True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _in_a_job():
        return
    skip = pytest.mark.skip(reason=NOT_IN_A_JOB)
    for item in items:
        if PARALLEL_DIR in pathlib.Path(item.path).resolve().parents:
            item.add_marker(skip)
