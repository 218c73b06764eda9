"""What each rank runs for :func:`baguahvd.runner.api.run`: one pickled function call.

``python -m baguahvd.runner.task PAYLOAD RESULTS`` loads ``(func, args, kwargs)`` from the
cloudpickle file ``PAYLOAD``, calls it, and writes ``RESULTS/rank.<rank>.pkl`` holding either
``("ok", value)`` or ``("error", traceback_text)``. The rank comes from the launcher's
environment (see :func:`baguahvd.common.config.launcher_rank`). A failing call also exits
with status 1, so the launcher reports the job as failed.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import cloudpickle

from baguahvd.common.config import launcher_rank

RESULT_PREFIX = "rank."
RESULT_SUFFIX = ".pkl"


def result_path(results: str, rank: int) -> str:
    """The file where rank ``rank`` leaves its outcome."""
    return os.path.join(results, f"{RESULT_PREFIX}{rank}{RESULT_SUFFIX}")


def _write(path: str, outcome: tuple[str, Any]) -> None:
    partial = path + ".partial"
    with open(partial, "wb") as out:
        cloudpickle.dump(outcome, out)
    os.replace(partial, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the pickled call; returns the process's exit status."""
    payload, results = argv if argv is not None else sys.argv[1:]
    rank = launcher_rank()
    if rank is None:
        sys.stderr.write("baguahvd.runner.task: no launcher rank in the environment\n")
        return 2
    path = result_path(results, rank)
    try:
        with open(payload, "rb") as source:
            func, args, kwargs = cloudpickle.load(source)
        value = func(*args, **kwargs)
    except BaseException:  # noqa: B036 - every failure is reported to the caller of run()
        _write(path, ("error", traceback.format_exc()))
        return 1
    try:
        _write(path, ("ok", value))
    except Exception:
        _write(path, ("error", "the result cannot be pickled:\n" + traceback.format_exc()))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
