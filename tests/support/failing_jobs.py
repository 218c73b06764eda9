"""Short jobs that fail on purpose: a prelude that starts baguahvd and warms the response
cache, a body per test, and the settings that make failures end a job in seconds.

Used by the end-to-end suites about failures (``tests/e2e/test_reliability.py``,
``tests/e2e/test_elastic_faults.py``); jobs start through :mod:`tests.support.jobs`.
"""

from __future__ import annotations

import pathlib
import textwrap

from tests.support import jobs

# A hang fails the test after this long; the jobs themselves end much sooner.
HARD_TIMEOUT_S = 150
# Startup of 2-3 ranks takes a few seconds, more on a loaded machine.
STARTUP_SLACK_S = 30

FAST_FAILURE = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3",
    "BAGUAHVD_EXIT_TIMEOUT_SECONDS": "3",
}

PRELUDE = """
import os
import signal
import sys
import time

import torch

import baguahvd.torch as hvd
from baguahvd.common.exceptions import PeerFailureError, StallError

hvd.init()
rank, size = hvd.rank(), hvd.size()
for _ in range(3):  # the last two are answered from the response cache
    hvd.allreduce(torch.ones(2), name="warmup")
"""


def run_script(
    tmp_path: pathlib.Path, body: str, np: int, env: dict[str, str] | None = None
) -> tuple[int, list[str], float]:
    """Runs the prelude and ``body`` on ``np`` ranks; returns the exit code, every rank's
    log and the job's duration in seconds."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(body))
    result = jobs.launch([str(script)], np, tmp_path, HARD_TIMEOUT_S, extra_env=env)
    return result.returncode, result.logs, result.elapsed_s


def joined_logs(logs: list[str]) -> str:
    """Every rank's log (its end), for an assertion message."""
    return jobs.format_logs(logs, tail=6000)
