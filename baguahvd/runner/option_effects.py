"""What ``horovodrun``'s options become in one launch: rank variables, mpirun flags, notes.

Pure functions of the parsed command line (and, for ``HOROVOD_START_TIMEOUT``, the
launcher's environment):

- :func:`rank_variables` sets the ``HOROVOD_*`` variables of the tuning, autotune, timeline,
  stall-check, library and logging options, and the variables of ``--network-interfaces``
  (``NCCL_SOCKET_IFNAME``, ``HOROVOD_GLOO_IFACE``) and ``--tcp`` (``NCCL_IB_DISABLE=1``).
  A switch given in its ``--no-*`` form sets its variable to ``0``; an option not given
  leaves the variable as the environment has it.
- :func:`mpirun_options` spells the multi-node options for Open MPI: ``-p``/``-i`` go into
  the ssh agent's arguments, ``--network-interfaces`` into the TCP interface settings of
  MPI traffic and of Open MPI's own out-of-band channel, ``--tcp`` keeps MPI on TCP,
  ``--prefix-output-with-timestamp`` timestamps each output line and ``--start-timeout``
  bounds the start of the ranks. Open MPI 5 (PRRTE) spells the launcher's settings
  differently from Open MPI 4, hence the version argument; ``None`` (unknown) takes the
  Open MPI 4 spelling.
- :func:`tcp_protocol_options` passes ``-mca btl_tcp_flags send`` to Open MPI 5 across
  hosts (``--open-mpi-tcp-defaults`` turns it off).
- :func:`launch_notes` lists the one-line notes for options that have no effect here.
- :func:`check_options` rejects values ``horovodrun`` rejects (negative sizes and times, a
  noise outside [0, 1]) and values Open MPI could not pass on (a key path with blanks).
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Mapping

from baguahvd.runner.hosts import LaunchError

LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")
DEFAULT_BINDING = ("--bind-to", "none", "--map-by", "slot")
"""How ranks are placed unless ``--binding-args`` says otherwise."""
START_TIMEOUT_VARIABLE = "HOROVOD_START_TIMEOUT"

_NONNEGATIVE = (
    ("fusion_threshold_mb", "--fusion-threshold-mb"),
    ("cycle_time_ms", "--cycle-time-ms"),
    ("cache_capacity", "--cache-capacity"),
    ("autotune_warmup_samples", "--autotune-warmup-samples"),
    ("autotune_steps_per_sample", "--autotune-steps-per-sample"),
    ("autotune_bayes_opt_max_samples", "--autotune-bayes-opt-max-samples"),
    ("stall_check_warning_time_seconds", "--stall-check-warning-time-seconds"),
    ("stall_check_shutdown_time_seconds", "--stall-check-shutdown-time-seconds"),
    ("num_nccl_streams", "--num-nccl-streams"),
    ("gloo_timeout_seconds", "--gloo-timeout-seconds"),
)
_VALUES = (
    ("cycle_time_ms", "CYCLE_TIME"),
    ("cache_capacity", "CACHE_CAPACITY"),
    ("timeline_filename", "TIMELINE"),
    ("stall_check_warning_time_seconds", "STALL_CHECK_TIME_SECONDS"),
    ("stall_check_shutdown_time_seconds", "STALL_SHUTDOWN_TIME_SECONDS"),
    ("log_level", "LOG_LEVEL"),
    ("autotune_log_file", "AUTOTUNE_LOG"),
    ("autotune_warmup_samples", "AUTOTUNE_WARMUP_SAMPLES"),
    ("autotune_steps_per_sample", "AUTOTUNE_STEPS_PER_SAMPLE"),
    ("autotune_bayes_opt_max_samples", "AUTOTUNE_BAYES_OPT_MAX_SAMPLES"),
    ("autotune_gaussian_process_noise", "AUTOTUNE_GAUSSIAN_PROCESS_NOISE"),
    ("num_nccl_streams", "NUM_NCCL_STREAMS"),
    ("thread_affinity", "THREAD_AFFINITY"),
    ("gloo_timeout_seconds", "GLOO_TIMEOUT_SECONDS"),
)
"""``(attribute, HOROVOD_ name)`` of the options exported with their value."""
_SWITCHES = (
    ("timeline_mark_cycles", "TIMELINE_MARK_CYCLES"),
    ("no_stall_check", "STALL_CHECK_DISABLE"),
    ("hierarchical_allreduce", "HIERARCHICAL_ALLREDUCE"),
    ("hierarchical_allgather", "HIERARCHICAL_ALLGATHER"),
    ("mpi_threads_disable", "MPI_THREADS_DISABLE"),
    ("autotune", "AUTOTUNE"),
)
"""``(attribute, HOROVOD_ name)`` of the on/off options: ``None`` not given, else a bool."""
_INTERFACE = re.compile(r"[A-Za-z0-9_.:@-]+")
_AFFINITY = re.compile(r"\d+(,\d+)*")


def _export(env: dict[str, str], name: str, value: str) -> None:
    """Sets ``HOROVOD_<name>``, and ``BAGUAHVD_<name>`` if set, so that the flag wins."""
    env[f"HOROVOD_{name}"] = value
    if f"BAGUAHVD_{name}" in env:
        env[f"BAGUAHVD_{name}"] = value


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def check_options(args: argparse.Namespace) -> None:
    """Rejects option values that ``horovodrun`` rejects or Open MPI cannot pass on.

    Args:
        args: the parsed command line (after ``--config-file`` was applied).

    Raises:
        LaunchError: a negative size or time, a noise outside [0, 1], a start timeout below
            1, a key path with blanks, or a malformed interface or affinity list.
    """
    for attribute, flag in _NONNEGATIVE:
        value = getattr(args, attribute, None)
        if value is not None and value < 0:
            raise LaunchError(f"{flag} must be at least 0, got {_text(value)}")
    noise = getattr(args, "autotune_gaussian_process_noise", None)
    if noise is not None and not 0 <= noise <= 1:
        raise LaunchError(f"--autotune-gaussian-process-noise must be in [0, 1], got {noise:g}")
    if args.start_timeout is not None and args.start_timeout < 1:
        raise LaunchError(f"--start-timeout must be at least 1 second, got {args.start_timeout}")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise LaunchError(f"-p/--ssh-port must be a port number, got {args.ssh_port}")
    if args.ssh_identity_file is not None and (
        not args.ssh_identity_file or any(char.isspace() for char in args.ssh_identity_file)
    ):
        raise LaunchError(
            f"-i/--ssh-identity-file {args.ssh_identity_file!r}: Open MPI splits ssh "
            "arguments at blanks; use a path without blanks"
        )
    for nic in args.nics or ():
        if not _INTERFACE.fullmatch(nic):
            raise LaunchError(f"--network-interfaces: {nic!r} is not an interface name")
    if args.thread_affinity is not None and not _AFFINITY.fullmatch(args.thread_affinity):
        raise LaunchError(
            f"--thread-affinity {args.thread_affinity!r}: expected a core number or a comma "
            "list of core numbers, one per local rank"
        )
    if args.binding_args is not None:
        _split("--binding-args", args.binding_args)


_LOOPBACK = re.compile(r"lo\d*(:.*)?")
"""Names of loopback interfaces (``lo``, ``lo0``, ``lo:1``)."""


def _split(flag: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as error:
        raise LaunchError(f"{flag} {text!r}: {error}") from None


def rank_variables(args: argparse.Namespace, env: dict[str, str]) -> list[str]:
    """Sets the variables the options give the ranks.

    Args:
        args: the parsed command line.
        env: the ranks' environment, changed in place.

    Returns:
        The names set here that ``mpirun`` does not export by prefix (``NCCL_*``), for
        ``-x``.
    """
    if args.fusion_threshold_mb is not None:
        _export(env, "FUSION_THRESHOLD", str(int(args.fusion_threshold_mb * 1024 * 1024)))
    for attribute, name in _VALUES:
        value = getattr(args, attribute, None)
        if value is not None:
            _export(env, name, _text(value))
    for attribute, name in _SWITCHES:
        value = getattr(args, attribute, None)
        if value is not None:
            _export(env, name, "1" if value else "0")
    if args.log_with_timestamp is not None:
        _export(env, "LOG_HIDE_TIME", "0" if args.log_with_timestamp else "1")
    if args.algorithm is not None:
        env["BAGUAHVD_ALGORITHM"] = args.algorithm
    extra: list[str] = []
    if args.nics:
        env["NCCL_SOCKET_IFNAME"] = ",".join(args.nics)
        env["HOROVOD_GLOO_IFACE"] = args.nics[0]
        extra.append("NCCL_SOCKET_IFNAME")
    if args.tcp_flag:
        env["NCCL_IB_DISABLE"] = "1"
        extra.append("NCCL_IB_DISABLE")
    return extra


def start_timeout(args: argparse.Namespace, env: Mapping[str, str]) -> int | None:
    """``--start-timeout``, else ``HOROVOD_START_TIMEOUT``, else ``None`` (no limit).

    Raises:
        LaunchError: ``HOROVOD_START_TIMEOUT`` is not a positive integer.
    """
    if args.start_timeout is not None:
        return int(args.start_timeout)
    text = env.get(START_TIMEOUT_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise LaunchError(
            f"{START_TIMEOUT_VARIABLE}={text!r} is not a positive number of seconds"
        )
    return int(text)


def binding_options(args: argparse.Namespace) -> list[str]:
    """``--binding-args`` split into words, or the default ``--bind-to none --map-by slot``."""
    if args.binding_args is None:
        return list(DEFAULT_BINDING)
    return _split("--binding-args", args.binding_args)


def mpirun_options(
    args: argparse.Namespace, env: Mapping[str, str], open_mpi_major: int | None
) -> list[str]:
    """The ``mpirun`` flags of the multi-node and output options.

    Args:
        args: the parsed command line.
        env: the launcher's environment (for ``HOROVOD_START_TIMEOUT``).
        open_mpi_major: Open MPI's major version; ``None`` when unknown.

    Returns:
        The flags, in a fixed order.
    """
    prrte = open_mpi_major is not None and open_mpi_major >= 5
    options: list[str] = []
    ssh_args: list[str] = []
    if args.ssh_port is not None:
        ssh_args += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file is not None:
        ssh_args += ["-i", args.ssh_identity_file]
    if ssh_args:
        if prrte:
            options += ["--prtemca", "plm_ssh_args", " ".join(ssh_args)]
        else:
            options += ["-mca", "plm_rsh_args", " ".join(ssh_args)]
    if args.tcp_flag:
        options += ["-mca", "pml", "ob1", "-mca", "btl", "tcp,self"]
    if args.nics:
        options += ["-mca", "btl_tcp_if_include", ",".join(args.nics)]
        # Open MPI's out-of-band channel refuses loopback interfaces ("No network interfaces
        # were found for out-of-band communications"): it keeps its own choice unless a
        # named interface is not one.
        oob = [nic for nic in args.nics if not _LOOPBACK.fullmatch(nic)]
        if oob and prrte:
            # PRRTE 5.0 crashes (SIGSEGV in mpirun) when prte_if_include lists several
            # interface names; its out-of-band channel needs only one.
            options += ["--prtemca", "prte_if_include", oob[0]]
        elif oob:
            options += ["-mca", "oob_tcp_if_include", ",".join(oob)]
    if args.tag_output:
        # Each line prefixed with its rank and stream, as horovodrun's: [1,<rank>]<stdout>:
        options.append("--tag-output")
    if args.prefix_output_with_timestamp:
        options.append("--timestamp-output")
    timeout = start_timeout(args, env)
    if timeout is not None and prrte:
        options += ["--spawn-timeout", str(timeout)]
    return options


def tcp_protocol_options(
    args: argparse.Namespace,
    env: Mapping[str, str],
    open_mpi_major: int | None,
    spans_hosts: bool,
    mpi_args: list[str],
) -> list[str]:
    """``-mca btl_tcp_flags send`` when Open MPI 5 launches across hosts.

    Open MPI 5's TCP BTL moves large messages with an emulated RDMA "put" by default; on
    the emulated 2-host cluster (benchmarks/emulated_cluster.sh) that ran at half the
    link rate from the second message on, and plain send/receive at the link rate
    (benchmarks/README.md). The setting only touches the TCP BTL, so it is harmless where
    MPI takes another transport. Left out with ``--open-mpi-tcp-defaults``, on one host
    (shared memory), with an unknown or older Open MPI, and when the user chose
    ``btl_tcp_flags`` already (``--mpi-args`` or ``OMPI_MCA_btl_tcp_flags``).
    """
    if args.open_mpi_tcp_defaults or not spans_hosts:
        return []
    if open_mpi_major is None or open_mpi_major < 5:
        return []
    if env.get("OMPI_MCA_btl_tcp_flags", "").strip() or any(
        "btl_tcp_flags" in word for word in mpi_args
    ):
        return []
    return ["-mca", "btl_tcp_flags", "send"]


def launch_notes(
    args: argparse.Namespace, env: Mapping[str, str], open_mpi_major: int | None
) -> list[str]:
    """One line for each option given that has no effect in this launch.

    Args:
        args: the parsed command line.
        env: the launcher's environment (for ``HOROVOD_START_TIMEOUT``).
        open_mpi_major: Open MPI's major version; ``None`` when unknown.

    Returns:
        The notes, without the program name.
    """
    notes: list[str] = []
    if args.disable_cache:
        notes.append("--disable-cache has no effect: baguahvdrun caches no host checks")
    if args.use_jsrun:
        notes.append("--jsrun is not supported; launching with Open MPI's mpirun instead")
    if args.gloo_timeout_seconds is not None and not args.use_gloo:
        notes.append(
            "--gloo-timeout-seconds: HOROVOD_GLOO_TIMEOUT_SECONDS is exported, but the ranks "
            "use MPI, not Gloo"
        )
    if start_timeout(args, env) is not None and not (
        open_mpi_major is not None and open_mpi_major >= 5
    ):
        version = "an unknown version" if open_mpi_major is None else f"v{open_mpi_major}"
        notes.append(
            f"--start-timeout/{START_TIMEOUT_VARIABLE} needs Open MPI 5 (--spawn-timeout); "
            f"mpirun is {version}, so the start is not timed"
        )
    return notes
