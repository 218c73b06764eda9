"""The argument parser of ``baguahvdrun``: every ``horovodrun`` 0.28.1 option, and ours.

``horovodrun``'s options keep their names, short forms and destinations. Its on/off options
come in pairs (``--autotune``/``--no-autotune``, ``--no-stall-check``/``--stall-check``, ...)
that store ``True`` or ``False`` in one attribute whose default is ``None``, so that
"not given" stays visible: ``--config-file`` fills only what the command line left unset,
and :mod:`baguahvd.runner.option_effects` exports a variable only for an option that was given.
Options of our own: ``-x``, ``--as-horovod``, ``--algorithm``, ``--shim-path`` and the
elastic ``--elastic``, ``--checkpoint-dir`` and ``--max-restarts``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from baguahvd import __version__
from baguahvd.runner.elastic.settings import DEFAULT_ELASTIC_TIMEOUT, DEFAULT_MAX_RESTARTS
from baguahvd.runner.option_effects import LOG_LEVELS


class _InterfacesAction(argparse.Action):
    """Adds the comma-separated interface names of one flag to the list of interfaces."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        nics = list(getattr(namespace, self.dest, None) or [])
        for name in str(values).split(","):
            name = name.strip()
            if not name:
                parser.error(f"{option_string} {values!r} has an empty interface name")
            if name not in nics:
                nics.append(name)
        setattr(namespace, self.dest, nics)


def _switch(
    group: argparse._ActionsContainer,
    on: Sequence[str],
    off: Sequence[str],
    dest: str,
    help_on: str,
    help_off: str | None = None,
) -> None:
    """Adds an on/off pair storing True/False in ``dest`` (default ``None``: not given)."""
    pair = group.add_mutually_exclusive_group()
    pair.add_argument(*on, dest=dest, action="store_const", const=True, help=help_on)
    pair.add_argument(
        *off,
        dest=dest,
        action="store_const",
        const=False,
        help=argparse.SUPPRESS if help_off is None else help_off,
    )


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
        "-np", "--num-proc", type=int, dest="num_proc", metavar="N", help="number of ranks"
    )
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
        "--disable-cache",
        action="store_true",
        help="accepted for horovodrun compatibility; baguahvdrun caches no host checks",
    )
    parser.add_argument(
        "--start-timeout",
        type=int,
        metavar="S",
        help="seconds for mpirun to start the ranks (default: HOROVOD_START_TIMEOUT, else no "
        "limit); mpirun's --spawn-timeout, Open MPI 5 only",
    )
    parser.add_argument(
        "--network-interfaces",
        "--network-interface",
        action=_InterfacesAction,
        dest="nics",
        metavar="IF[,IF...]",
        help="network interfaces for MPI traffic and Open MPI's own connections "
        "(btl_tcp_if_include, oob_tcp_if_include) and NCCL (NCCL_SOCKET_IFNAME); repeatable",
    )
    parser.add_argument(
        "--output-filename",
        metavar="DIR",
        help="folder for each rank's stdout and stderr (mpirun's output)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print the mpirun command line before running it"
    )
    parser.add_argument(
        "--config-file",
        metavar="FILE",
        help="horovodrun's YAML file of settings; flags on the command line win (needs PyYAML)",
    )
    ssh = parser.add_argument_group("SSH (passed to Open MPI's ssh agent)")
    ssh.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="ssh port of all hosts")
    ssh.add_argument(
        "-i", "--ssh-identity-file", metavar="FILE", help="private key file for ssh"
    )
    _add_tuning_arguments(parser)
    _add_library_arguments(parser)
    _add_host_arguments(parser)
    _add_elastic_arguments(parser)
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the program to run and its arguments"
    )
    return parser


def _add_tuning_arguments(parser: argparse.ArgumentParser) -> None:
    tuning = parser.add_argument_group("tuning (exported as HOROVOD_* variables)")
    tuning.add_argument(
        "--fusion-threshold-mb",
        type=float,
        metavar="MB",
        help="fusion buffer in MiB (HOROVOD_FUSION_THRESHOLD)",
    )
    tuning.add_argument(
        "--cycle-time-ms", type=float, metavar="MS", help="cycle time (HOROVOD_CYCLE_TIME)"
    )
    tuning.add_argument(
        "--cache-capacity",
        type=int,
        metavar="N",
        help="response cache entries (HOROVOD_CACHE_CAPACITY)",
    )
    for name in ("allreduce", "allgather"):
        variable = f"HOROVOD_HIERARCHICAL_{name.upper()}"
        _switch(
            tuning,
            [f"--hierarchical-{name}"],
            [f"--no-hierarchical-{name}"],
            f"hierarchical_{name}",
            f"{variable}=1",
            f"{variable}=0",
        )
    tuning.add_argument(
        "--algorithm",
        metavar="NAME",
        help="default communication algorithm of DistributedOptimizer (BAGUAHVD_ALGORITHM)",
    )

    autotune = parser.add_argument_group("autotune (exported as HOROVOD_AUTOTUNE* variables)")
    _switch(autotune, ["--autotune"], ["--no-autotune"], "autotune", "HOROVOD_AUTOTUNE=1")
    autotune.add_argument("--autotune-log-file", metavar="FILE", help="HOROVOD_AUTOTUNE_LOG")
    for flag, kind in (
        ("warmup-samples", int),
        ("steps-per-sample", int),
        ("bayes-opt-max-samples", int),
        ("gaussian-process-noise", float),
    ):
        autotune.add_argument(
            f"--autotune-{flag}",
            type=kind,
            metavar="N" if kind is int else "X",
            help=f"HOROVOD_AUTOTUNE_{flag.replace('-', '_').upper()}",
        )

    timeline = parser.add_argument_group("timeline")
    timeline.add_argument(
        "--timeline-filename", metavar="FILE", help="timeline JSON file (HOROVOD_TIMELINE)"
    )
    _switch(
        timeline,
        ["--timeline-mark-cycles"],
        ["--no-timeline-mark-cycles"],
        "timeline_mark_cycles",
        "HOROVOD_TIMELINE_MARK_CYCLES=1",
    )

    stall = parser.add_argument_group("stall check")
    _switch(
        stall,
        ["--no-stall-check"],
        ["--stall-check"],
        "no_stall_check",
        "HOROVOD_STALL_CHECK_DISABLE=1",
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


def _add_library_arguments(parser: argparse.ArgumentParser) -> None:
    library = parser.add_argument_group("library and MPI")
    _switch(
        library,
        ["--mpi-threads-disable"],
        ["--no-mpi-threads-disable"],
        "mpi_threads_disable",
        "HOROVOD_MPI_THREADS_DISABLE=1",
    )
    library.add_argument(
        "--mpi-args", metavar="ARGS", help='extra mpirun arguments, e.g. "--mca btl tcp,self"'
    )
    library.add_argument(
        "--tcp",
        action="store_true",
        dest="tcp_flag",
        help="only TCP: mpirun -mca pml ob1 -mca btl tcp,self, and NCCL_IB_DISABLE=1",
    )
    library.add_argument(
        "--open-mpi-tcp-defaults",
        action="store_true",
        help="keep Open MPI 5's TCP protocol for large messages (emulated RDMA put); by "
        "default a launch across hosts passes -mca btl_tcp_flags send, plain send/receive, "
        "which ran at the link rate where put ran at half of it",
    )
    library.add_argument(
        "--binding-args",
        metavar="ARGS",
        help='mpirun binding arguments instead of "--bind-to none --map-by slot"',
    )
    library.add_argument(
        "--num-nccl-streams", type=int, metavar="N", help="HOROVOD_NUM_NCCL_STREAMS"
    )
    library.add_argument(
        "--thread-affinity",
        metavar="CORES",
        help="core of the background thread, or one per local rank (HOROVOD_THREAD_AFFINITY)",
    )
    library.add_argument(
        "--gloo-timeout-seconds", type=int, metavar="S", help="HOROVOD_GLOO_TIMEOUT_SECONDS"
    )
    library.add_argument(
        "-x",
        action="append",
        dest="env_vars",
        metavar="VAR[=VALUE]",
        help="export VAR (set to VALUE if given) to the ranks; repeatable, like mpirun -x",
    )
    library.add_argument(
        "--as-horovod",
        action="store_true",
        help="make `import horovod.torch` load baguahvd.torch on the ranks "
        "(default: BAGUAHVD_AS_HOROVOD)",
    )

    logs = parser.add_argument_group("logging and output")
    logs.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help=f"HOROVOD_LOG_LEVEL: one of {', '.join(LOG_LEVELS)} (case-insensitive)",
    )
    stamps = logs.add_mutually_exclusive_group()
    for flags, value, text in (
        (["--log-with-timestamp", "--no-log-hide-timestamp"], True, None),
        (["--log-without-timestamp", "--log-hide-timestamp"], False, "HOROVOD_LOG_HIDE_TIME=1"),
    ):
        stamps.add_argument(
            *flags,
            dest="log_with_timestamp",
            action="store_const",
            const=value,
            help=argparse.SUPPRESS if text is None else text,
        )
    logs.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        action="store_true",
        help="timestamp each output line of the ranks (mpirun --timestamp-output)",
    )
    logs.add_argument(
        "--no-tag-output",
        action="store_false",
        dest="tag_output",
        help="print the ranks' lines as they are, without horovodrun's [1,<rank>]<stdout>: "
        "prefix (under --gloo: [<rank>]<stdout>:)",
    )

    controller = parser.add_argument_group("controller").add_mutually_exclusive_group()
    controller.add_argument(
        "--gloo",
        action="store_true",
        dest="use_gloo",
        help="start the ranks on this machine, joined by gloo, without mpirun",
    )
    controller.add_argument(
        "--mpi", action="store_true", dest="use_mpi", help="MPI controller (the default)"
    )
    controller.add_argument(
        "--jsrun",
        action="store_true",
        dest="use_jsrun",
        help="accepted for horovodrun compatibility; launches with mpirun",
    )


def _add_host_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "hosts (default: the Slurm/PBS/LSF/MPIJob allocation, else localhost:<np>)"
    )
    hosts = group.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H", "--hosts", metavar="HOSTS", help="hosts and their slots, host1:2,host2:4"
    )
    hosts.add_argument(
        "-hostfile", "--hostfile", metavar="FILE", help="file with one 'hostname slots=N' per line"
    )
    group.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="executable printing one 'host' or 'host:slots' per line, run before every "
        "launch and every second during one; implies --elastic",
    )


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
        "--checkpoint-dir",
        metavar="DIR",
        help="folder for the ranks' commits and host notices, kept at the end (default: a "
        "temporary folder, removed after success)",
    )
    elastic.add_argument(
        "--min-np",
        "--min-num-proc",
        type=int,
        dest="min_num_proc",
        metavar="N",
        help="fewest ranks of a launch (default -np, else 1)",
    )
    elastic.add_argument(
        "--max-np",
        "--max-num-proc",
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
