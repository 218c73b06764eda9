"""Horovod's Python launch API under the shim: ``horovod.run(func, args, np=...)`` runs the
function on every rank through ``baguahvdrun`` and returns the ranks' results in rank order."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.support import jobs

TIMEOUT_S = 240

SCRIPT = textwrap.dedent(
    """
    import horovod
    from horovod.runner import run as runner_run


    def total(offset):
        import torch
        import horovod.torch as hvd

        hvd.init()
        reduced = hvd.allreduce(torch.tensor([float(hvd.rank() + offset)]), op=hvd.Sum)
        return hvd.rank(), hvd.size(), reduced.item()


    def failing():
        import horovod.torch as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("bad batch 42")
        return "fine"


    assert horovod.run is runner_run
    print("RESULTS", horovod.run(total, args=(10,), np=2))
    try:
        horovod.run(failing, np=2)
    except RuntimeError as error:
        print("FAILED", type(error).__name__, "|", str(error).replace("\\n", " / "))
    """
)


def test_run_returns_every_ranks_result_and_reports_a_failing_rank(tmp_path) -> None:
    script = tmp_path / "launch_from_python.py"
    script.write_text(SCRIPT)
    env = jobs.job_env()
    env["PYTHONPATH"] = os.pathsep.join([jobs.shim_path(), env["PYTHONPATH"]])
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True,
        timeout=TIMEOUT_S, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "RESULTS [(0, 2, 21.0), (1, 2, 21.0)]" in result.stdout
    failed = next(line for line in result.stdout.splitlines() if line.startswith("FAILED"))
    assert "RunError" in failed and "rank 1:" in failed and "ValueError: bad batch 42" in failed
    assert "rank 0:" not in failed
