"""Elastic training: states that survive a restart, and the retry loop around training.

Horovod re-forms its Gloo ring inside the running processes. An MPI job's world cannot
shrink or grow in place, so baguahvd recovers it by restarting the job instead:

1. ``state.commit()`` keeps a copy of the state in memory on every rank (``save()``) and,
   when ``BAGUAHVD_ELASTIC_DIR`` is set (``baguahvdrun --elastic`` sets it), persists that
   copy to the folder: the first rank of every host writes commit ``n`` as
   ``commit-<n>.<host>.pt`` (tensors and plain values, loaded with ``weights_only=True``)
   and its manifest ``commit-<n>.<host>.json`` (job id, host, number, SHA-256), and keeps
   its previous commit until the new one is synced (loading verifies the checksum).
   ``commit()`` never waits for a write: the write runs on a background thread, one at a
   time, at low priority (:mod:`.writer`); a commit made while one is in flight waits in
   memory and is written next, unless a newer commit supersedes it first (it is then
   never written). So with commits faster than writes, the folder holds the newest commit
   that the writer could keep up with; once the newest durable commit is older than
   ``BAGUAHVD_ELASTIC_MAX_LAG_SECONDS``, a commit waits for the write in flight (see
   :mod:`.writer`). ``BAGUAHVD_ELASTIC_PERSIST_EVERY=k`` asks for the write of every k-th
   commit only. A failed write is logged at once and raised by the next commit (or at the end of
   the training function) as :class:`CommitWriteError`. Before the training function's
   wrapper returns or ends a launch for a resize, the newest commit is made durable;
   before it lets an error through, the writes in flight and due are finished. A process
   killed during a write leaves the previous commit whole, and the relaunch resumes from
   the newest durable commit.
2. When a rank dies or raises, the job ends (see the reliability section of the README)
   and ``baguahvdrun --elastic`` launches it again, possibly on other hosts.
3. In the new job, :func:`run_fn`'s wrapper finds the newest commit that verifies on any
   host (a damaged one is refused with its file named, and the one before is used),
   loads it into rank 0's state (sent over by a rank that sees it when rank 0's host has
   no copy), runs the reset callbacks, and syncs every rank from rank 0 before calling the
   training function again. Training resumes exactly at the
   last commit: no step is lost and none is applied twice.

Under ``baguahvdrun --gloo --elastic`` the ranks recover in place instead (steps 2 and 3
become Horovod's): a rank whose collective fails (``HorovodInternalError``) restores its
last in-memory commit, a rank that sees a host change keeps its state; both shut the
engine down and join the next round of the job's ranks (:mod:`.rounds`), where the
launcher has started processes only for lost or added slots (or, where ``--min-np``
allows, the survivors go on alone and a process for a lost slot joins at a later commit,
as an added host does); then the reset callbacks run and every rank syncs from rank 0, a
survivor. Only when every rank is lost does the job restart from the folder.

When the launcher's host discovery reports a change, it writes a notice into the folder;
the next ``commit()`` sees it on rank 0, every rank raises :class:`HostsUpdatedInterrupt`
and the wrapper ends the job with :data:`~baguahvd.common.elastic_protocol.RESIZE_EXIT_CODE`
so that the launcher relaunches it on the new hosts at once (in place under ``--gloo``).

When the training function returns, the folder records that the job finished. A later
run on the folder (launch ``0``) does not resume it: by default it says so and starts
afresh (``BAGUAHVD_ELASTIC_FINISHED`` chooses ``resume`` or ``refuse`` instead).
"""

from __future__ import annotations

import copy
import functools
import logging
import queue
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from baguahvd.common import elastic_protocol as protocol
from baguahvd.common.config import launch_from_env
from baguahvd.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.elastic import rounds
from baguahvd.torch.elastic.store import (
    CheckpointStore,
    CommitError,
    FinishedJobError,
    HostUpdateResult,
    check_plain,
)
from baguahvd.torch.elastic.writer import CommitWriteError, CommitWriter

logger = logging.getLogger(__name__)

_Result = TypeVar("_Result")

__all__ = [
    "CheckpointStore",
    "CommitError",
    "CommitWriteError",
    "FinishedJobError",
    "HostUpdateResult",
    "ObjectState",
    "State",
    "run_fn",
]


class State:
    """Horovod's elastic state: what a restart brings back.

    Subclasses define :meth:`save`, :meth:`restore`, :meth:`sync` and the payload that a
    commit persists. Every rank must call :meth:`commit` at the same points of training.

    Args:
        bcast_object: ``broadcast_object(obj, root_rank, name=None)`` of the framework.
        get_rank: returns this rank.
        allgather_object: ``allgather_object(obj, name=None)`` of the framework.
    """

    def __init__(
        self,
        bcast_object: Callable[..., Any],
        get_rank: Callable[[], int],
        allgather_object: Callable[..., list[Any]] | None = None,
    ) -> None:
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        self._allgather_object = allgather_object
        self._reset_callbacks: list[Callable[[], None]] = []
        self._host_messages: queue.Queue[tuple[float, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._commits = 0
        self._resumed = False
        config = runtime.config
        self._hosts_version = config.elastic_hosts_version if config is not None else 0
        folder = config.elastic_dir if config is not None else None
        self._store = CheckpointStore(folder) if folder else None
        self._writer = (
            CommitWriter(self._store, max_lag_s=config.elastic_max_lag_s)
            if self._store is not None and config is not None else None
        )
        self._persist_every = config.elastic_persist_every if config is not None else 1
        # torchrun's agent restarts workers from the top of the script: without a folder,
        # they start from the beginning. Said once, at the first commit.
        self._warn_in_memory_only = self._store is None and launch_from_env().agent_run is not None

    # -- Horovod's API ---------------------------------------------------------------------

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Adds functions to call after every reset (e.g. to rescale the learning rate to
        the new ``size()``); in baguahvd also after a restart resumes from a commit."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs :meth:`reset` and then the reset callbacks."""
        self._host_messages = queue.Queue()
        config = runtime.config
        if config is not None:
            # A round formed after a host notice carries its version: not news any more.
            self._hosts_version = max(self._hosts_version, config.elastic_hosts_version)
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None:
        """Records a host change; the next :meth:`check_host_updates` acts on it."""
        self._host_messages.put((timestamp, HostUpdateResult(update_res)))

    def commit(self) -> None:
        """Saves the state in memory and in the elastic folder, then checks for host
        changes (raising :class:`HostsUpdatedInterrupt` on every rank if there was one).

        Returns once the copy is taken, without waiting for any write: the elastic folder's
        write runs in the background, and a commit made while one is in flight is written
        after it unless a newer commit supersedes it (see :meth:`wait_for_commit`).

        Raises:
            CommitWriteError: an earlier commit's background write failed.
        """
        self.save()
        self._average_replicas()
        self._commits += 1
        if self._warn_in_memory_only:
            self._warn_in_memory_only = False
            if self._get_rank() == 0:
                logger.warning(
                    "torchrun's elastic agent runs this job, but BAGUAHVD_ELASTIC_DIR is not "
                    "set: commits stay in memory, and workers that the agent restarts start "
                    "training from the beginning; set it to a folder every node sees to "
                    "resume them from the last commit"
                )
        self._persist()
        self.check_host_updates()

    def wait_for_commit(self) -> None:
        """Makes the newest commit durable in the elastic folder: writes it if it waits
        behind a write in flight or ``BAGUAHVD_ELASTIC_PERSIST_EVERY`` left it in memory,
        and waits until its write has finished (on the first rank of each host; a no-op
        elsewhere and without a folder). ``commit()`` followed by this call is a
        synchronous commit.

        Raises:
            CommitWriteError: the write failed; the folder keeps the commits before it.
        """
        if self._writer is not None:
            self._writer.flush()

    def check_host_updates(self) -> None:
        """Raises :class:`HostsUpdatedInterrupt` on every rank when rank 0 has seen the host
        set change since the last check. Collective: every rank must call it."""
        # Rank 0 decides, so that every rank raises at the same commit.
        result = HostUpdateResult.no_update
        timestamp = self._last_updated_timestamp
        while not self._host_messages.empty():
            when, update = self._host_messages.get()
            result |= update
            timestamp = max(timestamp, when)
        if self._store is not None and self._get_rank() == 0:
            version, update = self._store.hosts_notice()
            if version > self._hosts_version:
                self._hosts_version = version
                result |= update
        decided, self._last_updated_timestamp, self._hosts_version = self._bcast_object(
            (int(result), timestamp, self._hosts_version), 0, name="elastic.host_updates"
        )
        if decided != HostUpdateResult.no_update:
            raise HostsUpdatedInterrupt(decided == HostUpdateResult.removed)

    def save(self) -> None:
        """Keeps a copy of the current state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Puts the last saved copy back."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every rank's state equal to rank 0's and saves it. Collective."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called before the reset callbacks; subclasses refresh size-dependent parts."""

    def _average_replicas(self) -> None:
        """Replaces the saved copy by its average over the ranks where ranks keep their own
        replicas (weight-averaging algorithms), so that a commit is the same on every
        rank. Collective, called by :meth:`commit` after :meth:`save`."""

    # -- persistence -----------------------------------------------------------------------

    def _payload(self) -> Any:
        """The saved state, as written to a commit file."""
        raise NotImplementedError

    def _load_payload(self, payload: Any) -> None:
        """Makes ``payload`` (from :meth:`_payload`) the saved and the current state."""
        raise NotImplementedError

    def _writes(self) -> bool:
        """Whether this rank writes commits: the first rank of each host, with a folder."""
        return self._writer is not None and runtime.local_rank() == 0

    def _persist(self) -> None:
        if not self._writes():
            return
        payload = self._payload()
        # A value that cannot be persisted is the caller's error: raise it here and now.
        check_plain(payload, "commit")
        assert self._writer is not None
        self._writer.submit(self._commits, payload, write=self._commits % self._persist_every == 0)

    def _settle_after_error(self) -> None:
        """Lets the writes in flight and due finish before an error ends the training
        function, so that a restart finds them; a failure was logged when it happened."""
        if self._writer is not None:
            try:
                self._writer.wait()
            except CommitWriteError:
                pass

    def _resume(self) -> bool:
        """Loads the newest intact persisted commit that any host sees into rank 0's state,
        ready for :meth:`sync`; returns False when there is none. Collective. Only the first
        call for a state reads the folder: later runs of the same state continue from
        memory. A finished job is not resumed by a new run (see ``elastic_finished``)."""
        if self._store is None or self._resumed:
            return False
        self._resumed = True
        if self._allgather_object is None:
            raise RuntimeError("resuming from a commit needs allgather_object")
        if self._finished_job_handled():
            return False
        # One reader per host: the ranks of a host see the same folder.
        leader = runtime.local_rank() == 0
        newest, payload = self._store.load_newest() if leader else (-1, None)
        seen = self._allgather_object(newest, name="elastic.resume")
        newest = max(seen)
        if newest < 0:
            return False
        holder = seen.index(newest)
        rank = self._get_rank()
        if holder != 0:  # only with per-host folders that rank 0's host lacks
            payload = self._bcast_object(
                payload if rank == holder else None, holder, name="elastic.resume.payload"
            )
        if rank == 0:
            self._load_payload(payload)
        self._commits = newest
        logger.info("resuming from commit %d (found by rank %d)", newest, holder)
        return True

    def _sync_in_place(self, holds_state: bool) -> None:
        """:meth:`sync` after an in-place reset, and rank 0's commit count, so that a rank
        that joined a running job numbers its commits on. When rank 0 does not hold the
        job's state (it joined the running job, and every rank that held the state is gone
        before passing it on), every rank first resumes from the newest commit in the
        folder, as a relaunch would. Collective."""
        if self._bcast_object(not holds_state, 0, name="elastic.state_lost"):
            if self._get_rank() == 0:
                logger.warning(
                    "no rank of this round holds the job's state (the ranks that did are "
                    "gone); resuming from the newest commit in the elastic folder"
                )
            self._resumed = False
            self._resume()
        self.sync()
        self._commits = self._bcast_object(self._commits, 0, name="elastic.commit_number")

    def _finished_job_handled(self) -> bool:
        """Applies the finished-job rule; True when the job starts afresh. Collective."""
        assert self._store is not None and self._allgather_object is not None
        config = runtime.config
        leader = runtime.local_rank() == 0
        finished = self._store.finished() if leader else None
        seen = self._allgather_object(finished, name="elastic.finished")
        done = [commit for commit in seen if commit is not None]
        if not done:
            return False
        policy = config.elastic_finished if config is not None else "fresh"
        relaunched = config is not None and config.elastic_restart > 0
        folder = self._store.folder
        if policy == "refuse":
            raise FinishedJobError(
                f"the job in {folder} finished training (at commit {max(done)}); use another "
                "folder, remove this one, or set BAGUAHVD_ELASTIC_FINISHED=fresh (train "
                "again) or =resume (continue from its last commit)"
            )
        if policy == "resume" or relaunched:
            if self._get_rank() == 0:
                logger.warning(
                    "the job in %s finished training at commit %d; resuming from its last "
                    "commit", folder, max(done)
                )
            return False
        if self._get_rank() == 0:
            logger.warning(
                "the job in %s finished training at commit %d; starting afresh and removing "
                "its commits (BAGUAHVD_ELASTIC_FINISHED=resume continues from them instead)",
                folder,
                max(done),
            )
            if finished is not None:
                self._store.start_fresh()
        # Rank 0 first, so that a shared folder gets one new job id; then every other
        # host whose own folder still records the finished job.
        self._bcast_object(None, 0, name="elastic.fresh")
        if leader and self._get_rank() != 0:
            self._store.reload_job()
            if self._store.finished() is not None:
                self._store.start_fresh()
        self._allgather_object(None, name="elastic.fresh.done")
        self._store.reload_job()
        return True

    def _finish(self) -> None:
        """Makes the last commit durable and records in the folder that the training
        function returned."""
        self.wait_for_commit()
        if self._writes():
            assert self._store is not None
            self._store.mark_finished(self._commits)


class ObjectState(State):
    """A state of plain Python values, given as keyword arguments and read and written as
    attributes (``state.epoch += 1``). Values are deep-copied when saved, so restoring
    also undoes changes made inside mutable values.

    Args:
        bcast_object: ``broadcast_object(obj, root_rank, name=None)`` of the framework.
        get_rank: returns this rank.
        allgather_object: ``allgather_object(obj, name=None)`` of the framework.
        **kwargs: the values.
    """

    def __init__(
        self,
        bcast_object: Callable[..., Any],
        get_rank: Callable[[], int],
        allgather_object: Callable[..., list[Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank, allgather_object)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self.save()
            self._saved_state = self._bcast_object(self._saved_state, 0, name="elastic.objects")
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            object.__setattr__(self, name, copy.deepcopy(value))

    def _payload(self) -> Any:
        return {"objects": self._saved_state}

    def _load_payload(self, payload: Any) -> None:
        objects = payload["objects"]
        if objects.keys() != self._saved_state.keys():
            logger.warning(
                "the commit holds the values %s but this state has %s; loading the shared ones",
                sorted(objects),
                sorted(self._saved_state),
            )
        self._saved_state.update(
            (name, value) for name, value in objects.items() if name in self._saved_state
        )
        self._set_attrs()


def run_fn(func: Callable[..., _Result], reset: Callable[[], None]) -> Callable[..., _Result]:
    """Wraps ``func(state, *args, **kwargs)`` in Horovod's elastic retry loop.

    The wrapper resumes from the newest persisted commit (when there is one), syncs the
    state from rank 0, and calls ``func``. A host change reported at a
    commit ends the job with ``RESIZE_EXIT_CODE`` under ``baguahvdrun --elastic`` (which
    relaunches it on the new hosts) once that commit is durable; outside it, ``reset()``
    re-initialises in place and training resumes after the reset callbacks. A failed
    collective (``HorovodInternalError``) ends this rank, after the commit writes in
    flight and due: the job cannot continue on a broken MPI world, and ``baguahvdrun --elastic``
    restarts it from the last durable commit. Under ``baguahvdrun --gloo --elastic`` both
    are handled in place, as Horovod does: a failed collective restores the last
    in-memory commit, a host change keeps the state as committed; ``reset()`` joins the
    next round of ranks (:mod:`.rounds`), the reset callbacks run and every rank syncs
    from rank 0 (a rank started for that round skips the folder and takes its state from
    that sync). When ``func`` returns, its last commit is
    made durable (raising :class:`CommitWriteError` if that fails) before the folder
    records that the job finished.

    Args:
        func: the training function; its first argument is the state.
        reset: re-initialises the framework (``shutdown(); init()``).

    Returns:
        The wrapper, with the signature of ``func``.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> _Result:
        config = runtime.config
        relaunched = config is not None and config.elastic_restart > 0
        in_place = rounds.in_process()
        # Whether this process holds the job's state: a process started for a running job
        # gets it from rank 0, a survivor, at its first sync.
        holds_state = True
        if in_place and rounds.joins_running_job():
            state._resumed = True
            needs_reset = True
            holds_state = False
        else:
            needs_reset = state._resume() or relaunched
        skip_sync = False
        while True:
            try:
                if needs_reset:
                    state.on_reset()
                if in_place:
                    state._sync_in_place(holds_state)
                    holds_state = True
                elif not skip_sync:
                    state.sync()
                if state._store is not None:
                    state._store.mark_training()
                result = func(state, *args, **kwargs)
            except HorovodInternalError as error:
                if not in_place:
                    if state._store is None:
                        logger.error(
                            "a collective failed; run under `baguahvdrun --elastic` to "
                            "restart from the last commit"
                        )
                    state._settle_after_error()
                    raise
                logger.warning("recovering in place from: %s", str(error).splitlines()[0])
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                if in_place:
                    skip_sync = False  # ranks started for added slots need the state
                elif state._store is not None:
                    logger.info("the hosts changed; ending this launch to resize the job")
                    state.wait_for_commit()  # the relaunch resumes from this commit
                    raise SystemExit(protocol.RESIZE_EXIT_CODE) from None
                else:
                    skip_sync = interrupt.skip_sync
            except BaseException:
                state._settle_after_error()
                raise
            else:
                state._finish()
                return result
            reset()
            needs_reset = True

    return wrapper
