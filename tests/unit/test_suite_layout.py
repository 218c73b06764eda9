"""How the suite treats ``tests/parallel`` outside a job: a run of the whole suite passes it
over (tests/e2e/test_parallel.py launches it), a command that names it skips every body and
says how to run it."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import _JOB_ENV, NOT_IN_A_JOB
from tests.support.jobs import ROOT


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_ENV}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def test_a_named_parallel_module_skips_with_the_way_to_run_it() -> None:
    result = _pytest("tests/parallel/test_smoke.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped" in result.stdout
    assert NOT_IN_A_JOB in result.stdout


def test_the_parallel_folder_is_passed_over_when_its_parent_is_collected() -> None:
    result = _pytest("--collect-only", "tests/unit/test_suite_layout.py", "tests/parallel/..")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tests/parallel/" not in result.stdout
    assert "test_suite_layout.py" in result.stdout
