"""Lifecycle and topology: ``init``, ``shutdown``, ranks and sizes, process-set registry.

One :class:`Runtime` object per process holds the engine and the topology (Horovod keeps the
same in its ``HorovodGlobalState``); the public functions are its bound methods.

``init()`` runs the engine on MPI or on gloo, as the launcher that started the process
implies (:mod:`~baguahvd.runtime.transport`): MPI under mpirun, gloo under torchrun,
``baguahvdrun --gloo`` and ``horovodrun --gloo``; an MPI job may move its CPU collectives
to gloo (across hosts over TCP, or BAGUAHVD_CPU_BACKEND=gloo). Nothing above the runtime
knows which.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from torch.utils.weak import WeakIdKeyDictionary

from baguahvd.backends import gloo, nccl
from baguahvd.backends.base import Communicator, ControlPlane, DeviceCommFactory
from baguahvd.common import capabilities, logging_setup
from baguahvd.common.config import Config, Launch, launch_from_env
from baguahvd.common.exceptions import (
    CollectiveNotInitializedError,
    NotInitializedError,
    ShutDownError,
)
from baguahvd.engine.engine import GLOBAL_PROCESS_SET_ID, Engine
from baguahvd.engine.messages import OpType
from baguahvd.engine.notices import describe_exception
from baguahvd.runtime.handles import HandleTable
from baguahvd.runtime.process_sets import ProcessSet, check_ranks, global_process_set
from baguahvd.runtime.transport import Transport, auto_transport, check_joined, choose

if TYPE_CHECKING:
    from baguahvd.backends.mpi import MPICommunicator

logger = logging.getLogger("baguahvd")

_INIT_FAILED = (
    "Horovod initialization failed. Please check log messages above for a more descriptive "
    "error."
)


class Runtime:
    """The process's baguahvd state between ``init()`` and ``shutdown()``."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.config: Config | None = None
        self.topology: Any = None
        self.handles = HandleTable()
        self._shut_down = False
        self._lock = threading.RLock()
        self._atexit_registered = False
        self._base_comm: Any = None
        """The MPI communicator of the job, or its :class:`~baguahvd.backends.gloo.GlooWorld`."""
        self.transport: Transport | None = None
        # The gloo job's store, reached at the first init() and kept for later ones (rank 0
        # may host it: a second one could not listen on the same port), until the launcher
        # names another address (an elastic job's next round).
        self._gloo_store: Any = None
        self._gloo_store_address: tuple[Any, ...] = ()
        # An MPI job's gloo data plane (BAGUAHVD_CPU_BACKEND), where it has one.
        self._split_world: Any = None
        # Makes device communicators; the engine's process sets and new_device_communicator.
        self._device_comms: DeviceCommFactory | None = None
        self._shutdown_callbacks: list[Callable[[], None]] = []
        self._stopped_engine: Engine | None = None
        self._previous_excepthook: Callable[..., Any] | None = None
        self.wrapped: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Per parameter, what the DistributedOptimizer that wraps it registered for it
        (:class:`baguahvd.torch.optimizer_protocol.Claim`), kept from one init() to the
        next. Here, not in an attribute of the parameter: pickling a whole model
        (``torch.save(model)``) would meet it there."""

    # -- lifecycle -----------------------------------------------------------------------

    def init(
        self, comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None
    ) -> None:
        """Starts baguahvd on every rank of ``comm``.

        Args:
            comm: ``None`` for all ranks of the job, a list of world ranks, or an mpi4py
                communicator.
            process_sets: process sets to register now (ids 1, 2, ... in list order), or
                ``"dynamic"`` to allow ``add_process_set`` later.

        Calling it again while initialised does nothing but forget outstanding handles.
        """
        with self._lock:
            self.handles.clear()
            # Idempotent, like Horovod: an engine that a peer's shutdown stopped stays in
            # place (its collectives raise the shutdown error) rather than starting a
            # collective re-initialisation that the departed peers would never join.
            if self.engine is not None:
                return
            # A process started to join a running elastic job waits here for its round.
            gloo.await_admission()
            config = Config.from_env()
            if process_sets == "dynamic":
                config = _with(config, dynamic_process_sets=True)
                process_sets = None
            try:
                sets = [] if isinstance(process_sets, str) else list(process_sets or ())
                self._start(config, comm, sets)
            except (ValueError, NotImplementedError, TypeError):
                raise
            except Exception as exc:
                logger.exception("initialization failed")
                raise ValueError(_INIT_FAILED) from exc
            if not self._atexit_registered:
                atexit.register(self._at_exit)
                self._previous_excepthook = sys.excepthook
                sys.excepthook = self._excepthook
                self._atexit_registered = True

    def _start(self, config: Config, comm: Any, process_sets: list[ProcessSet]) -> None:
        for index, process_set in enumerate(process_sets):
            if any(process_set is other for other in process_sets[:index]):
                raise ValueError(
                    "Horovod could not be initialized because process_sets entry number "
                    f"{index} is a duplicate: {process_set}"
                )
        launch = launch_from_env()
        transport = choose(config.cpu_backend, launch, comm)
        if transport is Transport.GLOO:
            base, topology, engine, resolved = self._connect_gloo(config, launch, comm,
                                                                  process_sets)
        else:
            base, topology, engine, resolved, transport = self._connect_mpi(
                config, launch, transport, comm, process_sets
            )
        check_joined(launch, transport, topology.size)
        for process_set, ranks in zip(process_sets, resolved):
            process_set.ranks = ranks
            process_set.bind(engine.register_process_set(ranks), self)
        global_process_set.ranks = list(range(topology.size))
        global_process_set.bind(GLOBAL_PROCESS_SET_ID, self)
        self.config = config
        self.topology = topology
        self.transport = transport
        self._base_comm = base
        self.engine = engine
        self._shut_down = False
        engine.start()

    def _connect_mpi(
        self,
        config: Config,
        launch: Launch,
        transport: Transport,
        comm: Any,
        process_sets: list[ProcessSet],
    ) -> tuple[Any, Any, Engine, list[list[int]], Transport]:
        # backends.mpi is imported here, not at the top: importing it starts MPI, which
        # must wait until prepare_mpi has chosen the thread level, and must not happen on
        # a mere ``import baguahvd.torch`` or in a gloo job.
        from baguahvd.backends import prepare_mpi

        prepare_mpi(config.mpi_threads_disable)
        from baguahvd.backends import mpi

        world = mpi.world()
        if comm is None:
            base = world
        elif mpi.is_communicator(comm):
            base = comm
            global_process_set.mpi_comm = comm
        else:
            ranks = sorted(int(r) for r in comm)
            if world.Get_rank() not in ranks:
                raise ValueError(
                    f"hvd.init(comm={ranks}) was called on rank {world.Get_rank()}, which is "
                    "not in the list; only the listed ranks may call it."
                )
            base = mpi.communicator_from_ranks(ranks)
        topology = mpi.Topology(base)
        logging_setup.configure(topology.rank, config.log_level, config.log_hide_time)
        control: ControlPlane = mpi.MPIControlPlane(base)
        spans_hosts = topology.local_size < topology.size
        if config.cpu_backend == "auto":
            transport = auto_transport(spans_hosts, launch, control)
        device_comms: DeviceCommFactory = mpi.nccl_communicator
        self._split_world = None
        store = None
        if transport is Transport.MPI_GLOO:
            try:
                store = gloo.connect_store_over(
                    control, launch.interface, config.gloo_timeout_s, spans_hosts
                )
            except ValueError as error:
                if config.cpu_backend != "auto":
                    raise
                if topology.rank == 0:
                    logger.warning("CPU collectives stay on MPI: %s", error)
                transport = Transport.MPI
        if store is not None:
            group_timeout_s = config.peer_timeout_s or 7 * 24 * 3600.0
            self._split_world = gloo.GlooWorld(
                store, topology.rank, topology.size, group_timeout_s + 60, launch.interface
            )
            control = gloo.SplitControlPlane(control, self._split_world)

            def device_comms(comm: Communicator) -> Communicator:
                return mpi.nccl_communicator(gloo.twin_of(comm))

        if topology.rank == 0 and transport is not Transport.MPI:
            logger.info("CPU collectives run on gloo, negotiation on MPI (%s)",
                        "BAGUAHVD_CPU_BACKEND=gloo" if config.cpu_backend == "gloo"
                        else "auto: the job spans hosts and MPI's transport is TCP")
        self._device_comms = device_comms
        engine = Engine(config, control, device_comms)
        resolved: list[list[int]] = []
        for process_set in process_sets:
            if process_set.mpi_comm is not None:
                mine = None
                if process_set.mpi_comm != mpi.null_communicator():
                    mine = mpi.world_ranks_of(process_set.mpi_comm, base)
                views = base.allgather(mine)
                ranks = next((v for v in views if v is not None), [])
            else:
                ranks = list(process_set.ranks or ())
            _check_new(ranks, topology.size, resolved, process_set)
            resolved.append(sorted(ranks))
        return base, topology, engine, resolved, transport

    def _connect_gloo(
        self, config: Config, launch: Launch, comm: Any, process_sets: list[ProcessSet]
    ) -> tuple[Any, Any, Engine, list[list[int]]]:
        if comm is not None:
            raise NotImplementedError(
                "hvd.init(comm=...) needs MPI, but this job runs on gloo (started by torchrun "
                "or horovodrun --gloo, or BAGUAHVD_CPU_BACKEND=gloo); register a process set "
                "of those ranks instead: hvd.init(process_sets=[hvd.ProcessSet(ranks)])."
            )
        logging_setup.configure(launch.rank, config.log_level, config.log_hide_time)
        # A collective waits for its peers as long as the watchdog lets it (0: forever).
        group_timeout_s = config.peer_timeout_s or 7 * 24 * 3600.0
        address = (launch.store_host, launch.store_port, launch.rendezvous_host,
                   launch.rendezvous_port, launch.rank == 0)
        if self._gloo_store is None or address != self._gloo_store_address:
            self._gloo_store = None  # a store this rank hosts closes before a new one opens
            self._gloo_store = gloo.connect_store(launch, config.gloo_timeout_s)
            self._gloo_store_address = address
        world = gloo.GlooWorld(
            self._gloo_store, launch.rank, launch.size, group_timeout_s + 60,
            launch.interface, launch.restart,
        )
        control = gloo.GlooControlPlane(world)
        topology = gloo.Topology(launch, control)
        device_comms = (
            gloo.host_staged_communicator if config.gpu_operations == "gloo"
            else gloo.device_communicator
        )
        self._device_comms = device_comms
        engine = Engine(config, control, device_comms)
        resolved: list[list[int]] = []
        for process_set in process_sets:
            if process_set.mpi_comm is not None:
                raise NotImplementedError(
                    "A process set given as an mpi4py communicator needs MPI, but this job "
                    "runs on gloo; give its ranks instead: hvd.ProcessSet([...])."
                )
            ranks = list(process_set.ranks or ())
            _check_new(ranks, topology.size, resolved, process_set)
            resolved.append(sorted(ranks))
        return world, topology, engine, resolved

    def shutdown(self) -> None:
        """Stops baguahvd on this rank; peers see their later collectives fail.

        Called while an exception propagates (in an ``except`` or ``finally`` block, or at
        exit after an uncaught one), it tells the other ranks that this rank failed and
        why: their collectives raise ``PeerFailureError`` with this exception's text.
        """
        self._shutdown(_failure(sys.exc_info()[1]))

    def _shutdown(self, failure: str | None) -> None:
        with self._lock:
            callbacks, self._shutdown_callbacks = self._shutdown_callbacks, []
        for callback in reversed(callbacks):
            try:
                callback()
            except Exception:
                logger.exception("a shutdown callback failed")
        with self._lock:
            self.handles.clear()
            engine = self.engine
            if engine is None:
                return
            self.engine = None
            self._shut_down = True
            self._stopped_engine = engine
        engine.shutdown(failure)
        if self.transport in (Transport.GLOO, Transport.MPI_GLOO):
            # gloo's groups own threads that must be joined before the interpreter ends;
            # left to exit, their destruction races with it and may abort the process.
            engine.release()

    def _at_exit(self) -> None:
        # The exception that ended the script, if the excepthook did not see it (a user's
        # hook replaced ours).
        self._shutdown(_failure(getattr(sys, "last_value", None)))
        engine = self._stopped_engine
        if engine is not None:
            # After a failure MPI_Finalize could wait forever for a rank that never exits.
            engine.leave_job()

    def _excepthook(
        self, kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        """Tells the other ranks at once that this rank dies of ``value``, before the
        interpreter joins threads and runs exit handlers; then reports it as usual."""
        engine = self.engine
        if engine is not None:
            engine.fail(describe_exception(value, tb))
        previous = self._previous_excepthook or sys.__excepthook__
        previous(kind, value, tb)

    # -- timeline --------------------------------------------------------------------------

    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        """Starts writing the timeline to ``file_path`` (rank 0 writes; a file being written
        is closed first). Needs HOROVOD_TIMELINE set at ``init()`` (``DYNAMIC`` to start
        it only now)."""
        if self.engine is None:
            raise NotInitializedError()
        assert self.config is not None
        if not self.config.timeline:
            raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
        self.engine.start_timeline(file_path, mark_cycles)

    def stop_timeline(self) -> None:
        """Ends the timeline file (a later :meth:`start_timeline` writes a new one)."""
        if self.engine is None:
            raise NotInitializedError()
        self.engine.stop_timeline()

    def is_initialized(self) -> bool:
        return self.engine is not None

    def is_registered(self, process_set_id: int) -> bool:
        """Whether the running engine knows the process set ``process_set_id``."""
        engine = self.engine
        return engine is not None and process_set_id in engine.process_sets

    def on_shutdown(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Calls ``callback()`` at the start of the next :meth:`shutdown` (also the one at
        interpreter exit), newest first, while the engine still runs. Returns a function
        that cancels the call."""
        with self._lock:
            self._shutdown_callbacks.append(callback)

        def cancel() -> None:
            with self._lock:
                self._shutdown_callbacks = [
                    c for c in self._shutdown_callbacks if c is not callback
                ]

        return cancel

    def new_communicator(self, ranks: Sequence[int] | None = None) -> MPICommunicator | None:
        """A private communicator for a thread of baguahvd's own (async model averaging):
        a duplicate of the job's communicator, or of its ``ranks`` only (in a gloo job, a
        gloo communicator with the same ``iallreduce``/``ibarrier`` methods).

        Collective: every rank (or every rank in ``ranks``) calls it, in the same order;
        non-members get ``None``. Using it from a thread other than the engine's needs
        MPI_THREAD_MULTIPLE (see :meth:`mpi_threads_supported`).
        """
        self.require_engine()
        if self.transport is Transport.GLOO:
            private: Any = self._base_comm.new_communicator(ranks)
            return cast("MPICommunicator | None", private)
        if self._split_world is not None:
            private = self._split_world.new_communicator(ranks)
            return cast("MPICommunicator | None", private)
        from baguahvd.backends import mpi

        return mpi.new_communicator(self._base_comm, ranks)

    def new_device_communicator(self, comm: Communicator) -> Communicator:
        """The device (GPU) communicator of ``comm``, a private communicator from
        :meth:`new_communicator`, made as the engine makes its process sets' (NCCL, its
        unique id carried by the MPI communicator or by the gloo job's store; ``comm``
        itself under HOROVOD_GPU_OPERATIONS=gloo), with the job's NCCL timeout.

        Nothing is communicated until its first collective, which creates the NCCL
        communicator and is collective over ``comm``'s members, on the calling thread; the
        communicator is the caller's alone, as ``comm`` is.
        """
        self.require_engine()
        assert self._device_comms is not None and self.config is not None
        device_comm = self._device_comms(comm)
        if isinstance(device_comm, nccl.NCCLCommunicator):
            device_comm.timeout_s = self.config.nccl_timeout_s
        return device_comm

    # -- access --------------------------------------------------------------------------

    def require_engine(self) -> Engine:
        """The running engine, or the error a collective raises without one."""
        engine = self.engine
        if engine is None:
            if self._shut_down:
                raise ShutDownError()
            raise CollectiveNotInitializedError()
        return engine

    def _require_topology(self) -> Any:
        if self.engine is None:
            raise NotInitializedError()
        return self.topology

    def size(self) -> int:
        """Number of ranks in the job."""
        return int(self._require_topology().size)

    def rank(self) -> int:
        """This process's rank in the job."""
        return int(self._require_topology().rank)

    def local_size(self) -> int:
        """Number of ranks on this node."""
        return int(self._require_topology().local_size)

    def local_rank(self) -> int:
        """This process's rank among the ranks on its node."""
        return int(self._require_topology().local_rank)

    def cross_size(self) -> int:
        """Number of nodes that have a rank with this process's local rank."""
        return int(self._require_topology().cross_size)

    def cross_rank(self) -> int:
        """This node's index among the nodes (for this local rank)."""
        return int(self._require_topology().cross_rank)

    def is_homogeneous(self) -> bool:
        """Whether every node runs the same number of ranks."""
        return bool(self._require_topology().is_homogeneous)

    def mpi_threads_supported(self) -> bool:
        """Whether MPI runs with MPI_THREAD_MULTIPLE (needs init); in a gloo job, whether
        threads may communicate at the same time, which they always may."""
        self._require_topology()
        if self.transport is Transport.GLOO:
            return True
        from baguahvd.backends import mpi

        return mpi.threads_supported()

    def gloo_enabled(self) -> bool:
        """Whether this job runs on gloo (it was started by torchrun, baguahvdrun --gloo or
        horovodrun --gloo, or BAGUAHVD_CPU_BACKEND=gloo without mpirun); False before
        ``init()``, and in an MPI job whose CPU collectives run on gloo (MPI negotiates)."""
        return self.transport is Transport.GLOO

    def mpi_enabled(self) -> bool:
        """Whether this job runs on MPI (negotiation; its CPU collectives may run on gloo);
        before ``init()``, whether MPI is available."""
        if self.transport is not None:
            return self.transport is not Transport.GLOO
        return capabilities.mpi_built()

    # -- process sets ----------------------------------------------------------------------

    def add_process_set(self, process_set: ProcessSet | Sequence[int]) -> ProcessSet:
        """Registers a process set after ``init()``; every rank must call it, in the same
        order, with the same ranks (members or not). Needs HOROVOD_DYNAMIC_PROCESS_SETS=1."""
        engine = self.require_engine()
        assert self.config is not None
        if not self.config.dynamic_process_sets:
            raise ValueError(
                "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after Horovod "
                "initialization."
            )
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
        if process_set.mpi_comm is not None:
            raise NotImplementedError(
                "Process sets given as an mpi4py communicator can only be registered at "
                "hvd.init(process_sets=[...])."
            )
        ranks = list(process_set.ranks or ())
        check_ranks(ranks, self.size())
        for state in list(engine.process_sets.values()):
            if list(state.ranks) == ranks:
                raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
        process_set.bind(_register(engine, ranks), self)
        return process_set

    def internal_process_set(self, ranks: Sequence[int]) -> ProcessSet:
        """A registered process set of exactly ``ranks`` for baguahvd's own use (hierarchical
        algorithms): an existing one when registered already, else one added now, whatever
        HOROVOD_DYNAMIC_PROCESS_SETS says. Collective: every rank calls it with the same
        ranks, in the same order."""
        engine = self.require_engine()
        ranks = sorted(ranks)
        check_ranks(ranks, self.size())
        for ident, state in list(engine.process_sets.items()):
            if list(state.ranks) == ranks:
                if ident == GLOBAL_PROCESS_SET_ID:
                    return global_process_set
                existing = ProcessSet(ranks)
                existing.bind(ident, self)
                return existing
        created = ProcessSet(ranks)
        created.bind(_register(engine, ranks), self)
        return created

    def remove_process_set(self, process_set: ProcessSet) -> bool:
        """Unregisters a process set (collectively); False for the global or an unknown set."""
        engine = self.require_engine()
        assert self.config is not None
        if not self.config.dynamic_process_sets:
            raise ValueError(
                "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after Horovod "
                "initialization."
            )
        ident = process_set.process_set_id
        if ident is None or ident == GLOBAL_PROCESS_SET_ID or ident not in engine.process_sets:
            return False
        handle = engine.submit(
            OpType.REMOVE_PROCESS_SET,
            "remove_process_set",
            GLOBAL_PROCESS_SET_ID,
            [],
            None,
            payload=(ident,),
        )
        handle.wait()
        process_set.unbind()
        return True

    def process_set_ids_and_ranks(self) -> dict[int, list[int]]:
        """Every registered process set's id and world ranks."""
        engine = self.require_engine()
        return {ident: list(state.ranks) for ident, state in engine.process_sets.items()}

    # Horovod's name: its tests call ``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()``.
    _get_process_set_ids_and_ranks = process_set_ids_and_ranks


def _check_new(
    ranks: list[int], size: int, resolved: list[list[int]], process_set: ProcessSet
) -> None:
    """Checks the ranks of the next process set given to ``init()``."""
    check_ranks(ranks, size)
    if sorted(ranks) in resolved:
        raise ValueError(
            "Horovod could not be initialized because process_sets entry number "
            f"{len(resolved)} is a duplicate: {process_set}"
        )


def _failure(exc: BaseException | None) -> str | None:
    """How ``exc`` is named to the other ranks; None when it is no failure (sys.exit)."""
    if exc is None or isinstance(exc, SystemExit):
        return None
    return describe_exception(exc)


def _register(engine: Engine, ranks: list[int]) -> int:
    """Adds a process set of ``ranks`` through the engine (collective); returns its id."""
    handle = engine.submit(
        OpType.ADD_PROCESS_SET, "add_process_set", GLOBAL_PROCESS_SET_ID, [], None, payload=ranks
    )
    handle.wait()
    return int(handle.extra)


def _with(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, **changes)


runtime = Runtime()
