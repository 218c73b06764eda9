"""End-to-end suites: each test launches whole jobs (``mpirun``, ``baguahvdrun``) through
:mod:`tests.support.jobs`, which bounds every launch by a timeout."""

from __future__ import annotations

import pytest

from tests.support import jobs


@pytest.fixture(scope="session", autouse=True)
def _mpirun() -> None:
    # Session-scoped so that it runs before any module-scoped fixture that launches a job.
    if jobs.find_mpirun() is None:
        pytest.skip(str(jobs.MpirunNotFoundError()))
