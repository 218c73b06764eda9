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
a child, again after a failure or a host change: see :mod:`baguahvd.runner.elastic`.

This module parses the command line and dispatches: the hosts are read by
:mod:`baguahvd.runner.hosts`, the command is built by :mod:`baguahvd.runner.mpirun`, and an
elastic job is run by :mod:`baguahvd.runner.elastic`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from collections.abc import Sequence

from baguahvd import __version__
from baguahvd.common import capabilities
from baguahvd.common.config import env_flag
from baguahvd.common.shim import shim_path
from baguahvd.runner.elastic.launcher import ElasticLauncher
from baguahvd.runner.elastic.settings import (
    DEFAULT_ELASTIC_TIMEOUT,
    DEFAULT_MAX_RESTARTS,
    ElasticSettings,
)
from baguahvd.runner.hosts import LaunchError
from baguahvd.runner.mpirun import (
    MpirunNotFoundError,
    build_command,
    find_mpirun,
    is_elastic,
    probe_mpirun,
    resolve_request,
)

LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")


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
        help=f"relaunches after failures before giving up (default {DEFAULT_MAX_RESTARTS})",
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
        help=f"seconds to wait for --min-np slots (default {DEFAULT_ELASTIC_TIMEOUT:g})",
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
    so that :func:`~baguahvd.runner.mpirun.build_command` depends on its arguments only.

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
    :meth:`baguahvd.runner.elastic.ElasticLauncher.run` for the status).

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
    if is_elastic(args):
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
        settings = ElasticSettings.from_args(args, env)
        mpirun = find_mpirun(env)
        open_mpi_major = probe_mpirun(mpirun)
    except LaunchError as error:
        parser.error(str(error))
    except MpirunNotFoundError as error:
        print(f"baguahvdrun: error: {error}", file=sys.stderr)
        return 1
    _warn_if_shadowing(args)
    launcher = ElasticLauncher(args, settings, env, mpirun=mpirun, open_mpi_major=open_mpi_major)
    return launcher.run()
