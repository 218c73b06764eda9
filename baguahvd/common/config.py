"""The runtime configuration, read once from the environment at ``init()``.

Every setting has a ``BAGUAHVD_<NAME>`` variable and, where Horovod has one, the
``HOROVOD_<NAME>`` alias; when both are set the ``BAGUAHVD_`` one wins. This is the only module
that reads ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

_LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")
_ELASTIC_FINISHED = ("fresh", "resume", "refuse")


def _lookup(env: Mapping[str, str], name: str, horovod_alias: bool = True) -> str | None:
    value = env.get(f"BAGUAHVD_{name}")
    if value is None and horovod_alias:
        value = env.get(f"HOROVOD_{name}")
    if value is not None and value.strip() == "":
        return None
    return value


def _as_bool(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    value = _lookup(env, name)
    if value is None:
        return default
    text = value.strip().lower()
    if text in ("true", "yes", "on"):
        return True
    if text in ("false", "no", "off"):
        return False
    try:
        return int(float(text)) > 0
    except ValueError:
        raise ValueError(
            f"HOROVOD_{name}/BAGUAHVD_{name}={value!r} is not a boolean; use 0 or 1."
        ) from None


def _as_number(
    env: Mapping[str, str],
    name: str,
    default: float,
    kind: type = float,
    horovod_alias: bool = True,
    minimum: float = 0,
) -> float:
    """Reads a finite number of at least ``minimum``; ``kind=int`` also rejects fractions.

    Every setting counts or times something, so inf, nan, negative values and fractions of
    a count mean nothing: they raise ``ValueError`` naming the variable instead of being
    rounded or clamped into something the user did not ask for.
    """
    value = _lookup(env, name, horovod_alias)
    if value is None:
        return default
    label = f"HOROVOD_{name}/BAGUAHVD_{name}" if horovod_alias else f"BAGUAHVD_{name}"
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{label}={value!r} is not a number.") from None
    if not math.isfinite(number):
        raise ValueError(f"{label}={value!r} must be a finite number.")
    if kind is int and not number.is_integer():
        raise ValueError(f"{label}={value!r} must be a whole number.")
    if number < minimum:
        bound = "negative" if minimum == 0 else f"less than {minimum:g}"
        raise ValueError(f"{label}={value!r} must not be {bound}.")
    return int(number) if kind is int else number


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of one baguahvd run. Build it with :meth:`from_env`."""

    fusion_threshold: int = 128 * 1024 * 1024
    """Bytes of the allreduce fusion buffer (HOROVOD_FUSION_THRESHOLD); 0 disables fusion."""
    cycle_time_ms: float = 1.0
    """Longest wait between negotiation cycles in milliseconds (HOROVOD_CYCLE_TIME). A cycle
    also starts as soon as the thread that submits requests waits for one or pauses for half
    a millisecond, so this bounds idle latency; a longer burst of submissions is negotiated
    after five cycle times at the latest."""
    cache_capacity: int = 1024
    """Entries of the response cache (HOROVOD_CACHE_CAPACITY); 0 disables it."""
    timeline: str | None = None
    """Timeline file written by rank 0, or ``DYNAMIC`` (HOROVOD_TIMELINE)."""
    timeline_mark_cycles: bool = False
    """Mark the start of every cycle that negotiated or ran something in the timeline
    (HOROVOD_TIMELINE_MARK_CYCLES)."""
    timeline_start_step: int = 0
    """Record the timeline only once this many optimizer steps have completed
    (BAGUAHVD_TIMELINE_START_STEP). A step is one ``step()`` call of any torch optimizer in
    rank 0's process; the count starts at ``init()``."""
    timeline_end_step: int = 0
    """Stop recording the timeline once this many optimizer steps have completed; 0 never
    (BAGUAHVD_TIMELINE_END_STEP). With the start step this keeps files of long runs small."""
    hierarchical_allreduce: bool = False
    """Reduce inside the node, allreduce across nodes, broadcast inside
    (HOROVOD_HIERARCHICAL_ALLREDUCE)."""
    hierarchical_allgather: bool = False
    """Gather inside the node first (HOROVOD_HIERARCHICAL_ALLGATHER)."""
    stall_check_disable: bool = False
    """Turn the stall inspector off, warnings and shutdown alike
    (HOROVOD_STALL_CHECK_DISABLE)."""
    stall_check_time_s: float = 60.0
    """Seconds before rank 0 warns that some ranks have submitted a collective that others
    have not (HOROVOD_STALL_CHECK_TIME_SECONDS)."""
    stall_shutdown_time_s: float = 600.0
    """Seconds before such a stall stops the job: every rank raises ``StallError`` naming
    the stalled collectives and the missing ranks (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).
    Horovod never shuts down by default; baguahvd does, after ten minutes, so that a job
    whose ranks went separate ways ends instead of hanging. 0 turns it off. A value below
    the warning time is rejected at ``init()`` (Horovod silently never shuts down then, which
    is never what the setting asked for). Raise it for
    programs where one rank legitimately works alone for longer (e.g. a long evaluation
    on rank 0 while the others wait in a collective)."""
    peer_timeout_s: float = 600.0
    """Seconds a negotiation cycle may wait for the other ranks before this rank declares
    the job broken and fails every collective with ``PeerFailureError``; 0 waits forever
    (BAGUAHVD_PEER_TIMEOUT_SECONDS). Cycles run every few milliseconds even when idle, so
    only a dead, frozen or deadlocked peer stops them. A peer on the same node whose
    process is gone is noticed within about two seconds whatever this says."""
    exit_timeout_s: float = 30.0
    """After a failure (a peer's exception, a stall shutdown, a dead peer), how long a
    rank's exit waits for the other ranks to exit too before it ends the whole job with
    MPI_Abort (BAGUAHVD_EXIT_TIMEOUT_SECONDS). Without it MPI_Finalize would wait forever
    for a rank that is stuck or sleeping."""
    log_level: str = "warning"
    """trace, debug, info, warning, error or fatal (HOROVOD_LOG_LEVEL)."""
    log_hide_time: bool = False
    """Leave timestamps out of log lines (HOROVOD_LOG_HIDE_TIME)."""
    dynamic_process_sets: bool = False
    """Allow add_process_set/remove_process_set after init (HOROVOD_DYNAMIC_PROCESS_SETS)."""
    elastic: bool = False
    """Elastic mode (HOROVOD_ELASTIC); ``baguahvdrun --elastic`` sets it for the ranks."""
    elastic_dir: str | None = None
    """Folder where ``hvd.elastic`` states persist their commits and read host-change
    notices (BAGUAHVD_ELASTIC_DIR; set by ``baguahvdrun --elastic``). With it, a relaunched
    job resumes from the newest commit found there."""
    elastic_restart: int = 0
    """How many launches of this elastic job came before this one
    (BAGUAHVD_ELASTIC_RESTART; set by ``baguahvdrun --elastic``)."""
    elastic_finished: str = "fresh"
    """What a new run does on an elastic folder whose job finished training
    (BAGUAHVD_ELASTIC_FINISHED): ``fresh`` (default) starts training again from the
    script's initial state and removes the finished job's commits, ``resume`` loads the
    finished job's last commit (so the training function continues from its end, e.g.
    after raising the epoch count), ``refuse`` raises an error. Relaunches of the same job
    by ``baguahvdrun --elastic`` always resume."""
    elastic_hosts_version: int = 0
    """Version of the host set this launch started with (BAGUAHVD_ELASTIC_HOSTS_VERSION;
    set by ``baguahvdrun --elastic``); a newer notice in ``elastic_dir`` interrupts
    training at the next commit."""
    mpi_threads_disable: bool = False
    """Ask MPI for a serialized rather than a multi-threaded library
    (HOROVOD_MPI_THREADS_DISABLE)."""
    disable_group_fusion: bool = False
    """Do not fuse grouped requests with other requests (HOROVOD_DISABLE_GROUP_FUSION)."""
    num_nccl_streams: int = 1
    """Accepted for Horovod compatibility and ignored (HOROVOD_NUM_NCCL_STREAMS): each
    process set's NCCL communicator runs on one CUDA stream."""
    nccl_timeout_s: float = 600.0
    """Seconds one GPU collective may take before its NCCL communicator is aborted and
    ``NCCLTimeoutError`` raised (BAGUAHVD_NCCL_TIMEOUT_SECONDS; torch's NCCL default)."""
    thread_affinity: tuple[int, ...] = ()
    """CPU cores for the engine thread, indexed by local rank (HOROVOD_THREAD_AFFINITY)."""
    algorithm: str | None = None
    """Default communication algorithm of DistributedOptimizer (BAGUAHVD_ALGORITHM)."""
    bucket_bytes: int = 10 * 1024 * 1024
    """Bucket size of the Bagua algorithms in bytes (BAGUAHVD_BUCKET_SIZE; Bagua's 10 MiB)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Reads every setting from ``env`` (default: ``os.environ``); bad values raise
        ``ValueError`` naming the variable."""
        env = os.environ if env is None else env
        log_level = (_lookup(env, "LOG_LEVEL") or "warning").strip().lower()
        if log_level not in _LOG_LEVELS:
            raise ValueError(
                f"HOROVOD_LOG_LEVEL={log_level!r} is not one of {', '.join(_LOG_LEVELS)}."
            )
        affinity_text = _lookup(env, "THREAD_AFFINITY")
        try:
            affinity = tuple(
                int(core) for core in (affinity_text or "").split(",") if core.strip()
            )
        except ValueError:
            raise ValueError(
                f"HOROVOD_THREAD_AFFINITY={affinity_text!r} is not a comma-separated list of "
                "cores."
            ) from None
        timeline = _lookup(env, "TIMELINE")
        finished = (_lookup(env, "ELASTIC_FINISHED", horovod_alias=False) or "fresh").strip()
        if finished.lower() not in _ELASTIC_FINISHED:
            raise ValueError(
                f"BAGUAHVD_ELASTIC_FINISHED={finished!r} is not one of "
                f"{', '.join(_ELASTIC_FINISHED)}."
            )
        config = cls(
            fusion_threshold=int(_as_number(env, "FUSION_THRESHOLD", cls.fusion_threshold, int)),
            cycle_time_ms=_as_number(env, "CYCLE_TIME", cls.cycle_time_ms),
            cache_capacity=int(_as_number(env, "CACHE_CAPACITY", cls.cache_capacity, int)),
            timeline=timeline,
            timeline_mark_cycles=_as_bool(env, "TIMELINE_MARK_CYCLES"),
            timeline_start_step=int(
                _as_number(env, "TIMELINE_START_STEP", 0, int, horovod_alias=False)
            ),
            timeline_end_step=int(
                _as_number(env, "TIMELINE_END_STEP", 0, int, horovod_alias=False)
            ),
            hierarchical_allreduce=_as_bool(env, "HIERARCHICAL_ALLREDUCE"),
            hierarchical_allgather=_as_bool(env, "HIERARCHICAL_ALLGATHER"),
            stall_check_disable=_as_bool(env, "STALL_CHECK_DISABLE"),
            stall_check_time_s=_as_number(
                env, "STALL_CHECK_TIME_SECONDS", cls.stall_check_time_s
            ),
            stall_shutdown_time_s=_as_number(
                env, "STALL_SHUTDOWN_TIME_SECONDS", cls.stall_shutdown_time_s
            ),
            peer_timeout_s=_as_number(
                env, "PEER_TIMEOUT_SECONDS", cls.peer_timeout_s, horovod_alias=False
            ),
            exit_timeout_s=_as_number(
                env, "EXIT_TIMEOUT_SECONDS", cls.exit_timeout_s, horovod_alias=False
            ),
            log_level=log_level,
            log_hide_time=_as_bool(env, "LOG_HIDE_TIME"),
            dynamic_process_sets=_as_bool(env, "DYNAMIC_PROCESS_SETS"),
            elastic=_as_bool(env, "ELASTIC"),
            elastic_dir=_lookup(env, "ELASTIC_DIR", horovod_alias=False),
            elastic_restart=int(
                _as_number(env, "ELASTIC_RESTART", 0, int, horovod_alias=False)
            ),
            elastic_finished=finished.lower(),
            elastic_hosts_version=int(
                _as_number(env, "ELASTIC_HOSTS_VERSION", 0, int, horovod_alias=False)
            ),
            mpi_threads_disable=_as_bool(env, "MPI_THREADS_DISABLE"),
            disable_group_fusion=_as_bool(env, "DISABLE_GROUP_FUSION"),
            num_nccl_streams=int(_as_number(env, "NUM_NCCL_STREAMS", 1, int, minimum=1)),
            nccl_timeout_s=_as_number(
                env, "NCCL_TIMEOUT_SECONDS", cls.nccl_timeout_s, horovod_alias=False, minimum=1
            ),
            thread_affinity=affinity,
            algorithm=_lookup(env, "ALGORITHM", horovod_alias=False),
            bucket_bytes=int(
                _as_number(env, "BUCKET_SIZE", cls.bucket_bytes, int, minimum=1)
            ),
        )
        if (
            not config.stall_check_disable
            and 0 < config.stall_shutdown_time_s < config.stall_check_time_s
        ):
            raise ValueError(
                f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={config.stall_shutdown_time_s:g} is less "
                f"than HOROVOD_STALL_CHECK_TIME_SECONDS={config.stall_check_time_s:g}, so a "
                "stall would never shut the job down; raise the shutdown time to at least the "
                "check time, lower the check time, or set the shutdown time to 0 to turn it off."
            )
        return config


def env_flag(name: str) -> bool:
    """Reads a boolean ``BAGUAHVD_<name>``/``HOROVOD_<name>`` outside of :class:`Config`
    (for switches needed before ``init()``, such as the import shim)."""
    return _as_bool(os.environ, name)


# Where launchers put a process's rank in the job: Open MPI, PMIx (srun --mpi=pmix), MPICH's
# PMI, horovodrun --gloo, torchrun, and Slurm's srun, in that order of precedence.
_RANK_VARIABLES = (
    "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "HOROVOD_RANK", "RANK", "SLURM_PROCID",
)


def launcher_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher announced it, before any communication.

    Returns:
        The rank, or ``None`` when no known launcher started the process.
    """
    env = os.environ if env is None else env
    for name in _RANK_VARIABLES:
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None
