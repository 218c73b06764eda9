"""Horovod's Python launch API: ``horovod.run(func, args=(), np=2, hosts=...)``.

:func:`run` pickles the call with cloudpickle into a temporary folder, launches
``python -m baguahvd.runner.task`` on every rank through ``baguahvdrun`` (a child process, so
every launcher option, the shim and the environment rules apply as on the command line), and
returns what ``func`` returned on each rank, in rank order. ``func`` and what it references
must be importable or picklable by value on the ranks, as with Horovod.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from baguahvd.runner.task import RESULT_PREFIX, RESULT_SUFFIX, result_path


class RunError(RuntimeError):
    """The job started by :func:`run` failed; the message carries the failing ranks' errors."""


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    np: int = 1,
    min_np: int | None = None,
    max_np: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: int | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
) -> list[Any]:
    """Runs ``func(*args, **kwargs)`` on ``np`` ranks and returns every rank's result.

    Takes ``horovod.runner.run``'s arguments; each maps onto the ``baguahvdrun`` flag of the
    same meaning (``hosts`` → ``-H``, ``ssh_port`` → ``-p``, ``min_np`` → ``--min-np``...).

    Args:
        func: the function every rank calls; it usually calls ``hvd.init()`` itself.
        args: positional arguments for ``func``.
        kwargs: keyword arguments for ``func``.
        np: number of ranks.
        executable: the Python the ranks run (default: this process's interpreter).

    Returns:
        The ranks' return values, indexed by rank.

    Raises:
        RunError: the launch failed or a rank raised; the message holds each failing rank's
            traceback.
    """
    folder = tempfile.mkdtemp(prefix="baguahvd-run-")
    try:
        payload = os.path.join(folder, "call.pkl")
        with open(payload, "wb") as out:
            cloudpickle.dump((func, tuple(args), dict(kwargs or {})), out)
        results = os.path.join(folder, "results")
        os.mkdir(results)
        command = [
            sys.executable, "-m", "baguahvd.run",
            *launcher_flags(
                np=np, min_np=min_np, max_np=max_np, slots=slots, reset_limit=reset_limit,
                cooldown_range=cooldown_range, hosts=hosts, hostfile=hostfile,
                start_timeout=start_timeout, ssh_port=ssh_port,
                ssh_identity_file=ssh_identity_file, disable_cache=disable_cache,
                output_filename=output_filename, verbose=verbose, use_gloo=use_gloo,
                use_mpi=use_mpi, mpi_args=mpi_args, network_interface=network_interface,
            ),
            executable or sys.executable, "-m", "baguahvd.runner.task", payload, results,
        ]
        status = subprocess.run(command, check=False).returncode
        return _collect(results, status)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def launcher_flags(**options: Any) -> list[str]:
    """Turns :func:`run`'s launch options into ``baguahvdrun`` flags (``None``: left out)."""
    flags: list[str] = []
    valued = {
        "np": "-np", "min_np": "--min-np", "max_np": "--max-np",
        "slots": "--slots-per-host", "reset_limit": "--reset-limit", "hosts": "-H",
        "hostfile": "--hostfile", "start_timeout": "--start-timeout", "ssh_port": "-p",
        "ssh_identity_file": "-i", "output_filename": "--output-filename",
        "mpi_args": "--mpi-args", "network_interface": "--network-interface",
    }
    switches = {
        "disable_cache": "--disable-cache", "verbose": "--verbose", "use_gloo": "--gloo",
        "use_mpi": "--mpi",
    }
    for name, value in options.items():
        if value is None:
            continue
        if name in valued:
            flags += [valued[name], str(value)]
        elif name in switches:
            if value:
                flags.append(switches[name])
        elif name == "cooldown_range":
            low, high = value
            flags += ["--blacklist-cooldown-range", str(low), str(high)]
        else:
            raise TypeError(f"run() got an unexpected launch option {name!r}")
    return flags


def _collect(results: str, status: int) -> list[Any]:
    ranks = sorted(
        int(name[len(RESULT_PREFIX):-len(RESULT_SUFFIX)])
        for name in os.listdir(results)
        if name.startswith(RESULT_PREFIX) and name.endswith(RESULT_SUFFIX)
    )
    outcomes = []
    for rank in ranks:
        with open(result_path(results, rank), "rb") as source:
            outcomes.append(cloudpickle.load(source))
    errors = [
        f"rank {rank}:\n{detail}"
        for rank, (kind, detail) in zip(ranks, outcomes)
        if kind == "error"
    ]
    if errors:
        raise RunError("the function raised on some ranks:\n" + "\n".join(errors))
    if status != 0:
        raise RunError(f"the job failed with exit status {status} before every rank returned")
    if ranks != list(range(len(ranks))):
        raise RunError(f"results came back from ranks {ranks} only")
    return [value for _, value in outcomes]
