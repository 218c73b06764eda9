"""Test-suite layout: ``tests/unit`` runs in this process; ``tests/parallel`` bodies run on
every rank under mpirun and are launched by ``tests/e2e/test_parallel.py``; the other
``tests/e2e`` suites launch whole scripts and ``baguahvdrun`` jobs; ``tests/support`` holds
what they share (launching jobs, the library tables tests parametrize over)."""

from __future__ import annotations

import os

from tests.support.jobs import PARALLEL_WORKER_ENV

# The parallel bodies are only collected inside the mpirun workers the driver launches.
collect_ignore_glob = [] if os.environ.get(PARALLEL_WORKER_ENV) else ["parallel/*"]
