"""Test-suite layout: ``tests/unit`` runs in this process; ``tests/parallel`` bodies run on
every rank under mpirun and are launched by ``tests/test_parallel.py``."""

from __future__ import annotations

import os

WORKER_ENV = "BAGUAHVD_TEST_WORKER"

# The parallel bodies are only collected inside the mpirun workers the driver launches.
collect_ignore_glob = [] if os.environ.get(WORKER_ENV) else ["parallel/*"]
