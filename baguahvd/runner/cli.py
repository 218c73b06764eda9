"""``baguahvdrun``: launch a training script on several ranks, like ``horovodrun``.

It accepts every ``horovodrun`` option (:mod:`baguahvd.runner.command_line`), turns the tuning
flags into the ``HOROVOD_*`` variables baguahvd reads at ``init()``, and replaces itself
with an Open MPI ``mpirun`` command carrying what users otherwise have to remember:
``--allow-run-as-root`` for root, ``--oversubscribe`` when more local slots than cores are
asked for, ``--bind-to none``, ``--map-by slot``, ``-H`` and ``-x`` for every variable the
ranks need::

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

This module parses the command line (with ``--config-file``) and dispatches: the hosts are
read by :mod:`baguahvd.runner.hosts` or found by :mod:`baguahvd.runner.allocation`, the
command is built by :mod:`baguahvd.runner.mpirun`, and an elastic job is run by
:mod:`baguahvd.runner.elastic`. Options that have no effect here print a one-line note to
stderr. ``--gloo`` starts the ranks on this machine without mpirun, joined by gloo
(:mod:`baguahvd.runner.local_gloo`).
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
from baguahvd.compat.aliases import shim_path
from baguahvd.runner import local_gloo
from baguahvd.runner.command_line import make_parser
from baguahvd.runner.configfile import apply_config, read_config
from baguahvd.runner.elastic.launcher import ElasticLauncher
from baguahvd.runner.elastic.rounds import GlooElasticLauncher
from baguahvd.runner.elastic.settings import ElasticSettings
from baguahvd.runner.hosts import LaunchError
from baguahvd.runner.local_gloo import check_local
from baguahvd.runner.mpirun import (
    MpirunNotFoundError,
    build_command,
    find_mpirun,
    is_elastic,
    probe_mpirun,
    resolve_request,
)
from baguahvd.runner.option_effects import launch_notes

__all__ = ["check_build_table", "main", "make_parser", "parse_args"]

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


def parse_args(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parses ``baguahvdrun``'s command line.

    ``--as-horovod`` defaults to ``BAGUAHVD_AS_HOROVOD``/``HOROVOD_AS_HOROVOD``, read here
    so that :func:`~baguahvd.runner.mpirun.build_command` depends on its arguments only.
    ``--config-file`` is read here too: its settings fill what the command line left unset,
    and its notes (ignored keys) are kept in ``config_notes``.

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
    args.config_notes = []
    if args.config_file is not None:
        try:
            args.config_notes = apply_config(args, read_config(args.config_file))
        except LaunchError as error:
            parser.error(str(error))
    args.as_horovod_from_env = False
    if not args.as_horovod:
        try:
            args.as_horovod = args.as_horovod_from_env = env_flag("AS_HOROVOD")
        except ValueError as error:
            parser.error(str(error))
    return args


def _print_notes(
    args: argparse.Namespace, env: dict[str, str], open_mpi_major: int | None
) -> None:
    try:
        notes = args.config_notes + launch_notes(args, env, open_mpi_major)
    except LaunchError as error:  # already reported by the request checks
        notes = [str(error)]
    for note in notes:
        print(f"baguahvdrun: note: {note}", file=sys.stderr)


def _warn_if_shadowing(args: argparse.Namespace) -> None:
    """One note per job that an installed Horovod is hidden from the ranks, where the user
    may not know it: ``--as-horovod`` came from the environment rather than the command
    line, or ``--verbose`` asks for every detail."""
    if not args.as_horovod:
        return
    if not (args.as_horovod_from_env or args.verbose):
        return
    try:
        spec = importlib.util.find_spec("horovod")
    except (ImportError, ValueError):
        return
    if spec is None or spec.origin is None:
        return
    if not os.path.abspath(spec.origin).startswith(shim_path() + os.sep):
        print(
            f"baguahvdrun: note: BAGUAHVD_AS_HOROVOD/--as-horovod hides the Horovod "
            f"installed at {os.path.dirname(spec.origin)} from the ranks",
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
    if args.use_gloo:
        return _launch_gloo(parser, args, env)
    if is_elastic(args):
        return _launch_elastic(parser, args, env)
    try:
        resolve_request(args, env)  # usage errors come before looking for mpirun
        mpirun = find_mpirun(env)
        open_mpi_major = probe_mpirun(mpirun)
        command, child_env = build_command(
            args, env, mpirun=mpirun, open_mpi_major=open_mpi_major
        )
    except LaunchError as error:
        parser.error(str(error))
    except MpirunNotFoundError as error:
        print(f"baguahvdrun: error: {error}", file=sys.stderr)
        return 1
    _print_notes(args, env, open_mpi_major)
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


def _launch_gloo(
    parser: argparse.ArgumentParser, args: argparse.Namespace, env: dict[str, str]
) -> int:
    if is_elastic(args):
        return _launch_gloo_elastic(parser, args, env)
    try:
        hosts, num_proc = resolve_request(args, env)
        check_local(hosts)
    except LaunchError as error:
        parser.error(str(error))
    _warn_if_shadowing(args)
    sys.stdout.flush()
    sys.stderr.flush()
    return local_gloo.launch(args, env, hosts, num_proc)


def _launch_gloo_elastic(
    parser: argparse.ArgumentParser, args: argparse.Namespace, env: dict[str, str]
) -> int:
    try:
        settings = ElasticSettings.from_args(args, env)
        if settings.fixed_hosts is not None:
            check_local(settings.fixed_hosts)
    except LaunchError as error:
        parser.error(str(error))
    _warn_if_shadowing(args)
    return GlooElasticLauncher(args, settings, env, mpirun="").run()


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
    _print_notes(args, env, open_mpi_major)
    _warn_if_shadowing(args)
    launcher = ElasticLauncher(args, settings, env, mpirun=mpirun, open_mpi_major=open_mpi_major)
    return launcher.run()
