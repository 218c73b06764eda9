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


def _as_bool(
    env: Mapping[str, str], name: str, default: bool = False, horovod_alias: bool = True
) -> bool:
    value = _lookup(env, name, horovod_alias)
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
            f"{_label(name, horovod_alias)}={value!r} is not a boolean; use 0 or 1."
        ) from None


def _label(name: str, horovod_alias: bool) -> str:
    """How an error names a setting's variables."""
    return f"HOROVOD_{name}/BAGUAHVD_{name}" if horovod_alias else f"BAGUAHVD_{name}"


def _as_number(
    env: Mapping[str, str],
    name: str,
    default: float,
    horovod_alias: bool = True,
    minimum: float = 0,
    whole: bool = False,
) -> float:
    """Reads a finite number of at least ``minimum``; ``whole`` also rejects fractions.

    Every setting counts or times something, so inf, nan, negative values and fractions of
    a count mean nothing: they raise ``ValueError`` naming the variable instead of being
    rounded or clamped into something the user did not ask for.
    """
    value = _lookup(env, name, horovod_alias)
    if value is None:
        return default
    label = _label(name, horovod_alias)
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{label}={value!r} is not a number.") from None
    if not math.isfinite(number):
        raise ValueError(f"{label}={value!r} must be a finite number.")
    if whole and not number.is_integer():
        raise ValueError(f"{label}={value!r} must be a whole number.")
    if number < minimum:
        bound = "negative" if minimum == 0 else f"less than {minimum:g}"
        raise ValueError(f"{label}={value!r} must not be {bound}.")
    return number


def _as_count(
    env: Mapping[str, str],
    name: str,
    default: int,
    horovod_alias: bool = True,
    minimum: int = 0,
) -> int:
    """Reads a whole number of at least ``minimum`` (see :func:`_as_number`)."""
    return int(_as_number(env, name, default, horovod_alias, minimum, whole=True))


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of one baguahvd run. Build it with :meth:`from_env`."""

    fusion_threshold: int = 128 * 1024 * 1024
    """Bytes of the allreduce fusion buffer (HOROVOD_FUSION_THRESHOLD); 0 disables fusion."""
    unfused_bytes: int | None = None
    """CPU tensors of at least this many bytes are reduced in a call of their own instead of
    being copied in and out of the fusion buffer (BAGUAHVD_UNFUSED_BYTES). None (unset)
    takes the data plane's own size, at which one more call costs less than the two copies
    (2 MiB over MPI, 8 MiB over gloo); 0 fuses every tensor, as Horovod does."""
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
    elastic_persist_every: int = 1
    """Persist every k-th ``state.commit()`` to ``elastic_dir`` (BAGUAHVD_ELASTIC_PERSIST_EVERY,
    a whole number of at least 1; default 1, every commit). The other commits stay in memory
    only; the last commit of a training function that returns, or that stops because the
    hosts changed, is persisted whatever its number. A failure resumes from the newest
    durable commit, so up to k commits' worth of steps are redone, and more when commits
    come faster than the background writes (one is written at a time, the newest next)."""
    elastic_max_lag_s: float = 60.0
    """How far, in seconds, the newest durable commit may fall behind before ``commit()``
    waits for the write in flight (BAGUAHVD_ELASTIC_MAX_LAG_SECONDS; default 60). The
    background writer runs at a low priority, so on steps that keep every core busy it
    gets little CPU and its writes can take minutes; once the oldest commit asked to be
    written has waited longer than this for itself or a newer one to become durable, a
    commit waits until the write in flight ends (the step's CPU goes to the writer), so
    a restart redoes about this much training at most, plus a write. 0 makes every commit
    made during a write wait for it."""
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
    ``NCCLTimeoutError`` raised (BAGUAHVD_NCCL_TIMEOUT_SECONDS; torch's NCCL default). Also
    the deadline of creating a communicator (unique id, init and first connection setup)."""
    nccl_average: bool = False
    """Average allreduces and reducescatters of floating CUDA tensors use NCCL's own average
    (``ncclAvg``, NCCL 2.10 and later; BAGUAHVD_NCCL_AVERAGE): one pass less, but NCCL
    scales each input by ``1/size`` in the tensor's precision before summing, so results
    differ from Horovod's (a sum scaled in float64) in the last bits. Off by default."""
    nccl_single_rank: bool = False
    """A job of one rank sends CUDA tensors through a one-rank NCCL communicator instead of
    the identity fast path (BAGUAHVD_NCCL_SINGLE_RANK), and the Bagua algorithms run at
    size 1 instead of leaving the optimizer alone: for smoke-testing the GPU path on one
    GPU."""
    thread_affinity: tuple[int, ...] = ()
    """CPU cores for the engine thread, indexed by local rank (HOROVOD_THREAD_AFFINITY)."""
    algorithm: str | None = None
    """Default communication algorithm of DistributedOptimizer (BAGUAHVD_ALGORITHM)."""
    bucket_bytes: int = 10 * 1024 * 1024
    """Bucket size of the Bagua algorithms in bytes (BAGUAHVD_BUCKET_SIZE; Bagua's 10 MiB),
    and the most bytes of one of DistributedOptimizer's gradient buckets (which are also
    held to the fusion threshold)."""
    gradient_buckets: bool = True
    """DistributedOptimizer's default path keeps gradients in flat buckets from its second
    step on, each allreduced in place as one request when its last gradient is ready, with
    no copy through a fusion buffer (BAGUAHVD_GRADIENT_BUCKETS; on by default). Gradients
    become views of the buckets (``zero_grad()`` sets them to None; backward points them at
    their views again, zeroed). 0 reduces every gradient as its own request, as Horovod
    does."""
    check_call_sites: bool = False
    """Record the call site of every unnamed collective and fail those that ranks pair from
    different sites (BAGUAHVD_CHECK_CALL_SITES). Off by default: a script may legitimately
    reach one collective from different lines on different ranks."""
    autotune: bool = False
    """Tune the fusion threshold and cycle time online during the first steps, then keep the
    best (HOROVOD_AUTOTUNE; see :mod:`~baguahvd.engine.autotune`)."""
    autotune_log: str | None = None
    """CSV file where rank 0 logs each autotune sample's settings and score
    (HOROVOD_AUTOTUNE_LOG)."""
    autotune_warmup_samples: int = 3
    """Samples measured at the initial settings and discarded (HOROVOD_AUTOTUNE_WARMUP_SAMPLES)."""
    autotune_steps_per_sample: int = 10
    """Steps measured per sample; a step ends each time the first collective name to recur
    is seen again (HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE)."""
    autotune_max_samples: int = 20
    """Candidate settings measured before the best freezes
    (HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES)."""
    autotune_gaussian_process_noise: float = 0.8
    """Accepted for Horovod compatibility (HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, 0..1); the
    search is a deterministic grid with local refinement, which has no noise model."""
    cpu_backend: str = "auto"
    """Transport of CPU tensors: ``mpi``, ``gloo`` or ``auto`` (BAGUAHVD_CPU_BACKEND; else
    Horovod's HOROVOD_CPU_OPERATIONS or HOROVOD_CONTROLLER, which ``horovodrun --gloo`` sets
    to ``gloo``). ``auto`` takes gloo when torchrun or ``horovodrun --gloo`` started the
    process; under an MPI launcher it keeps MPI for rendezvous and negotiation and runs the
    CPU collectives on gloo when the job spans hosts and MPI's transport is TCP, on MPI
    otherwise. ``gloo`` under an MPI launcher means that split; ``mpi`` means MPI for
    everything (see :mod:`baguahvd.runtime.transport`)."""
    gloo_timeout_s: float = 30.0
    """Seconds the gloo rendezvous waits for the other ranks (HOROVOD_GLOO_TIMEOUT_SECONDS)."""
    gpu_operations: str = "nccl"
    """Transport of CUDA tensors: ``nccl`` under every launcher, or ``gloo``, which copies
    them through host memory in jobs that run on gloo (torchrun, ``horovodrun --gloo``)
    (BAGUAHVD_GPU_OPERATIONS / HOROVOD_GPU_OPERATIONS). Jobs under MPI always use NCCL."""

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
            fusion_threshold=_as_count(env, "FUSION_THRESHOLD", cls.fusion_threshold),
            unfused_bytes=(
                _as_count(env, "UNFUSED_BYTES", 0, horovod_alias=False)
                if _lookup(env, "UNFUSED_BYTES", horovod_alias=False) is not None
                else None
            ),
            cycle_time_ms=_as_number(env, "CYCLE_TIME", cls.cycle_time_ms),
            cache_capacity=_as_count(env, "CACHE_CAPACITY", cls.cache_capacity),
            timeline=timeline,
            timeline_mark_cycles=_as_bool(env, "TIMELINE_MARK_CYCLES"),
            timeline_start_step=_as_count(env, "TIMELINE_START_STEP", 0, horovod_alias=False),
            timeline_end_step=_as_count(env, "TIMELINE_END_STEP", 0, horovod_alias=False),
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
            elastic_restart=_as_count(env, "ELASTIC_RESTART", 0, horovod_alias=False),
            elastic_finished=finished.lower(),
            elastic_hosts_version=_as_count(
                env, "ELASTIC_HOSTS_VERSION", 0, horovod_alias=False
            ),
            elastic_persist_every=_as_count(
                env, "ELASTIC_PERSIST_EVERY", cls.elastic_persist_every, horovod_alias=False,
                minimum=1,
            ),
            elastic_max_lag_s=_as_number(
                env, "ELASTIC_MAX_LAG_SECONDS", cls.elastic_max_lag_s, horovod_alias=False
            ),
            mpi_threads_disable=_as_bool(env, "MPI_THREADS_DISABLE"),
            disable_group_fusion=_as_bool(env, "DISABLE_GROUP_FUSION"),
            num_nccl_streams=_as_count(env, "NUM_NCCL_STREAMS", 1, minimum=1),
            nccl_timeout_s=_as_number(
                env, "NCCL_TIMEOUT_SECONDS", cls.nccl_timeout_s, horovod_alias=False, minimum=1
            ),
            nccl_single_rank=_as_bool(env, "NCCL_SINGLE_RANK", horovod_alias=False),
            nccl_average=_as_bool(env, "NCCL_AVERAGE", horovod_alias=False),
            thread_affinity=affinity,
            algorithm=_lookup(env, "ALGORITHM", horovod_alias=False),
            bucket_bytes=_as_count(env, "BUCKET_SIZE", cls.bucket_bytes, minimum=1),
            gradient_buckets=_as_bool(env, "GRADIENT_BUCKETS", True, horovod_alias=False),
            check_call_sites=_as_bool(env, "CHECK_CALL_SITES", horovod_alias=False),
            autotune=_as_bool(env, "AUTOTUNE"),
            autotune_log=_lookup(env, "AUTOTUNE_LOG") or None,
            autotune_warmup_samples=_as_count(
                env, "AUTOTUNE_WARMUP_SAMPLES", cls.autotune_warmup_samples
            ),
            autotune_steps_per_sample=_as_count(
                env, "AUTOTUNE_STEPS_PER_SAMPLE", cls.autotune_steps_per_sample, minimum=1
            ),
            autotune_max_samples=_as_count(
                env, "AUTOTUNE_BAYES_OPT_MAX_SAMPLES", cls.autotune_max_samples, minimum=1
            ),
            autotune_gaussian_process_noise=_as_number(
                env, "AUTOTUNE_GAUSSIAN_PROCESS_NOISE", cls.autotune_gaussian_process_noise
            ),
            cpu_backend=_cpu_backend(env),
            gpu_operations=_gpu_operations(env),
            gloo_timeout_s=_as_number(env, "GLOO_TIMEOUT_SECONDS", cls.gloo_timeout_s),
        )
        if config.autotune_gaussian_process_noise > 1.0:
            raise ValueError(
                "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE="
                f"{config.autotune_gaussian_process_noise:g} must be in [0, 1]."
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


_CPU_BACKENDS = ("auto", "mpi", "gloo")


def _cpu_backend(env: Mapping[str, str]) -> str:
    label, value = "BAGUAHVD_CPU_BACKEND", env.get("BAGUAHVD_CPU_BACKEND", "").strip()
    if not value:
        for name in ("HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER"):
            text = env.get(name, "").strip().lower()
            if text in ("mpi", "gloo"):
                return text
        return "auto"
    if value.lower() not in _CPU_BACKENDS:
        raise ValueError(f"{label}={value!r} is not one of {', '.join(_CPU_BACKENDS)}.")
    return value.lower()


_GPU_OPERATIONS = ("nccl", "gloo")


def _gpu_operations(env: Mapping[str, str]) -> str:
    value = _lookup(env, "GPU_OPERATIONS")
    if value is None:
        return "nccl"
    if value.strip().lower() not in _GPU_OPERATIONS:
        raise ValueError(
            f"{_label('GPU_OPERATIONS', True)}={value!r} is not one of "
            f"{', '.join(_GPU_OPERATIONS)}."
        )
    return value.strip().lower()


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


# What each launcher tells its processes (besides the rank above).
_MPI_LAUNCH = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT")
_MPI_COMPONENTS = ("pml", "btl", "mtl")
_HOROVOD_GLOO = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                 "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                 "HOROVOD_GLOO_RENDEZVOUS_PORT")


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the launcher started this process, read from its variables before any
    communication. Build it with :func:`launch_from_env`."""

    launcher: str | None = None
    """``"mpi"`` (mpirun, srun --mpi=pmix, MPICH), ``"torchrun"`` (also ``baguahvdrun
    --gloo``), ``"horovodrun-gloo"``, or ``None`` for a process started alone."""
    variables: tuple[str, ...] = ()
    """The launcher's variables that were found, for error messages."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    store_host: str | None = None
    """torchrun: the TCP store's host (MASTER_ADDR)."""
    store_port: int | None = None
    """torchrun: the TCP store's port (MASTER_PORT)."""
    store_hosted_by_agent: bool = False
    """torchrun: its agent hosts the store (TORCHELASTIC_USE_AGENT_STORE), so rank 0 must
    not start one."""
    restart: int = 0
    """torchrun: how many times its agent restarted the workers
    (TORCHELASTIC_RESTART_COUNT); keys of earlier attempts stay in the agent's store."""
    agent_run: str | None = None
    """torchrun: the run id of the elastic agent that started this worker
    (TORCHELASTIC_RUN_ID); ``None`` when no agent did (the agent may restart workers)."""
    rendezvous_host: str | None = None
    """horovodrun --gloo: its HTTP rendezvous server (HOROVOD_GLOO_RENDEZVOUS_ADDR)."""
    rendezvous_port: int | None = None
    """horovodrun --gloo: HOROVOD_GLOO_RENDEZVOUS_PORT."""
    interface: str | None = None
    """The network interface gloo uses (HOROVOD_GLOO_IFACE); ``None``: torch's choice."""
    mpi_components: tuple[tuple[str, str], ...] = ()
    """Open MPI's transport components as mpirun's ``--mca`` set them for the ranks
    (``OMPI_MCA_pml``, ``OMPI_MCA_btl``, ``OMPI_MCA_mtl``), as (name, value) pairs."""


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number.") from None


def launch_from_env(env: Mapping[str, str] | None = None) -> Launch:
    """Reads what the launcher told this process (see :class:`Launch`).

    Precedence: an MPI launcher's variables first (MPI stays the default under mpirun),
    then horovodrun --gloo's, then torchrun's. Horovod's rank variables next to torchrun's
    without a Horovod rendezvous server (``baguahvdrun --gloo`` sets both) mean torchrun's
    store.
    """
    env = os.environ if env is None else env

    def found(names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(name for name in names if env.get(name, "").strip())

    interface = env.get("HOROVOD_GLOO_IFACE", "").strip() or None
    if found(_MPI_LAUNCH):
        components = tuple(
            (name, env[f"OMPI_MCA_{name}"].strip())
            for name in _MPI_COMPONENTS
            if env.get(f"OMPI_MCA_{name}", "").strip()
        )
        return Launch("mpi", found(_MPI_LAUNCH), interface=interface,
                      mpi_components=components)
    torchrun = found(("RANK", "WORLD_SIZE"))
    # horovodrun --gloo always names its rendezvous server; baguahvdrun --gloo sets Horovod's
    # rank variables too, next to torchrun's, and its ranks meet on torchrun's store.
    if found(("HOROVOD_RANK", "HOROVOD_SIZE")) and (
        found(("HOROVOD_GLOO_RENDEZVOUS_ADDR",)) or not torchrun
    ):
        size = _int(env, "HOROVOD_SIZE", 1)
        return Launch(
            "horovodrun-gloo",
            found(_HOROVOD_GLOO),
            rank=_int(env, "HOROVOD_RANK", 0),
            size=size,
            local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
            local_size=_int(env, "HOROVOD_LOCAL_SIZE", size),
            cross_rank=_int(env, "HOROVOD_CROSS_RANK", 0),
            cross_size=_int(env, "HOROVOD_CROSS_SIZE", 1),
            rendezvous_host=env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "").strip() or None,
            rendezvous_port=_int(env, "HOROVOD_GLOO_RENDEZVOUS_PORT", 0) or None,
            interface=interface,
        )
    if torchrun:
        size = _int(env, "WORLD_SIZE", 1)
        local_size = _int(env, "LOCAL_WORLD_SIZE", size)
        return Launch(
            "torchrun",
            found(_TORCHRUN),
            rank=_int(env, "RANK", 0),
            size=size,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_size=local_size,
            cross_rank=_int(env, "GROUP_RANK", 0),
            cross_size=_int(env, "GROUP_WORLD_SIZE", max(size // max(local_size, 1), 1)),
            store_host=env.get("MASTER_ADDR", "").strip() or None,
            store_port=_int(env, "MASTER_PORT", 0) or None,
            store_hosted_by_agent=env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower()
            in ("1", "true"),
            restart=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            agent_run=env.get("TORCHELASTIC_RUN_ID", "").strip() or None,
            interface=interface,
        )
    return Launch(interface=interface)
