"""``baguahvdrun --gloo --elastic``: recovery inside the running ranks.

A gloo job can change its membership in place, so under ``--gloo`` a launch is not one
``mpirun`` but a pool of local rank processes that the launcher keeps across failures and
host changes, meeting in *rounds* (the protocol is
:mod:`baguahvd.common.elastic_protocol`'s; the ranks' side is
:mod:`baguahvd.torch.elastic.rounds`):

* Round ``0`` of a launch starts one process per rank, as ``baguahvdrun --gloo`` does, each
  with a worker id that names it for the rest of its life.
* When a rank of the current round exits with a non-zero status (a kill -9, an exception)
  or asks for a new round (a rank whose collective failed, or that saw a host change at a
  commit), the launcher forms the next round at once: it reads the hosts, keeps the
  surviving workers in their rank order (rank 0 of the new round is a survivor and holds
  the state every rank syncs from) and, where it can, their local ranks (a process keeps
  the GPU it chose by local rank; a new one gets the lost one's local rank, so its GPU),
  leaves the surplus out when slots were removed, picks
  a new TCP port for the round's store, writes the round file, and starts processes only
  for the slots no survivor fills. Survivors restore their last in-memory commit there;
  nothing restarts.
* When ranks were lost and the survivors are at least ``--min-np``, they do not wait for
  the new processes: the next round is theirs alone, and the processes started for the
  lost slots wait in ``hvd.init()`` until they are ready. Once one says it is (a readiness
  file), the launcher writes a host notice, as for an added host: the survivors ask for a
  new round at their next commit (``HostsUpdatedInterrupt``), and the round after it takes
  in every process that is ready by then. A waiting process that ends before it joins
  counts as a failure and is replaced.
* A failure (a rank that died, or a request while the host set is unchanged: a failed
  collective) counts against ``--max-restarts``, and every round after the first against
  ``--reset-limit``, as relaunches do; a request after a host change does not count as a
  failure.
* When every rank of the round has failed, the launch has failed: the relaunch loop of
  :class:`~baguahvd.runner.elastic.launcher.ElasticLauncher` starts a new launch, which
  resumes from the commits in the folder (the restart-based path of MPI jobs).
* Once a rank of the current round ends with status 0, training is over: no round is
  formed any more, and the launch's status is the worst of its ranks'.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

from baguahvd.common.elastic_protocol import (
    HOSTS_ADDED,
    JOIN_ENV,
    READY_PREFIX,
    ROUND_ENV,
    ROUND_FILE,
    ROUND_REQUEST_PREFIX,
    ROUND_TIMEOUT_ENV,
    WORKER_ENV,
)
from baguahvd.runner.elastic.launcher import ElasticLauncher
from baguahvd.runner.elastic.settings import ElasticError, say
from baguahvd.runner.hosts import Host, LaunchError, format_hosts
from baguahvd.runner.local_gloo import (
    GRACE_S,
    KILL_AFTER_S,
    check_local,
    exit_status,
    free_port,
    rank_variables,
    shared_environment,
    wait_all,
)

_POLL_S = 0.02
_DEATH_GRACE_S = 0.2
_STDERR_TAIL_LINES = 400


@dataclass
class _Worker:
    """One rank process of the pool."""

    ident: int
    process: subprocess.Popen[bytes]
    left_out_at: float | None = None
    """When a round left it out (it then ends by itself, or is stopped)."""


class GlooElasticLauncher(ElasticLauncher):
    """:class:`ElasticLauncher` whose launches are pools of local gloo ranks that recover in
    place (see the module docstring)."""

    _pool: _Pool | None = None

    def _run_launch(
        self, index: int, hosts: list[Host], size: int, env: dict[str, str]
    ) -> tuple[int, str]:
        try:
            check_local(hosts)
        except LaunchError as error:
            raise ElasticError(str(error)) from None
        pool = _Pool(self, index, env)
        self._pool = pool
        try:
            return pool.run(size)
        finally:
            self._pool = None
            pool.stop_all()

    def _forward(self, signum: int) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.signal_all(signum)


class _Pool:
    """The rank processes of one launch and its rounds."""

    def __init__(self, launcher: GlooElasticLauncher, index: int, env: dict[str, str]) -> None:
        self._launcher = launcher
        self._index = index
        args = launcher._args
        self._shared = shared_environment(args, env)
        self._shared[ROUND_TIMEOUT_ENV] = f"{launcher._settings.timeout:g}"
        self._folder = env["BAGUAHVD_ELASTIC_DIR"]
        self._tag = bool(args.tag_output)
        self._timestamp = bool(args.prefix_output_with_timestamp)
        self._workers: dict[int, _Worker] = {}
        self._members: list[int] = []  # worker ids in rank order
        # Started for lost slots while the survivors go on without them, in start order;
        # those that said they are ready, and whether the ranks were told of them.
        self._waiting: list[int] = []
        self._ready: set[int] = set()
        self._join_version: int | None = None  # the host notice that told the ranks
        self._home: dict[int, int] = {}  # worker id -> the local rank it started with
        self._slots: dict[int, int] = {}  # worker id -> its local rank in the round
        self._round = -1
        self._formed_version = launcher._version  # the host set's version at the last round
        self._next_ident = 0
        self._lock = threading.Lock()
        self._copiers: list[threading.Thread] = []
        self._tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)

    # -- the loop --------------------------------------------------------------------------

    def run(self, size: int) -> tuple[int, str]:
        """Runs the launch; returns its status and the end of the ranks' stderr."""
        launcher = self._launcher
        settings = launcher._settings
        self._form(launcher._known, size, "")
        while True:
            if launcher._signal is not None:
                return self._finish(), self._report()
            time.sleep(_POLL_S)
            codes = {ident: self._workers[ident].process.poll() for ident in self._members}
            if any(code == 0 for code in codes.values()):
                return self._finish(), self._report()
            lost = [ident for ident, code in codes.items() if code is not None]
            if lost and len(lost) == len(codes):
                return self._finish(), self._report()
            names = self._folder_names()
            failed = self._watch_waiting(names)
            if failed is not None:
                return self._give_up(failed), self._report()
            requested = self._requested(names)
            if not lost and not requested:
                self._stop_left_out()
                continue
            hosts_changed = launcher._version != self._formed_version
            go_on = False  # whether the survivors may go on without the slots left to fill
            if requested and not lost and not hosts_changed:
                # A rank whose collective failed may ask before its peer's death shows.
                time.sleep(_DEATH_GRACE_S)
                codes = {ident: self._workers[ident].process.poll() for ident in self._members}
                lost = [ident for ident, code in codes.items() if code is not None]
            if lost or not hosts_changed:
                what = (
                    ", ".join(
                        f"rank {self._members.index(i)} (status {exit_status(codes[i] or 0)})"
                        for i in lost
                    )
                    + " failed"
                    if lost
                    else "a collective failed"
                )
                if launcher._failures >= settings.max_restarts:
                    say(
                        f"{what}; giving up after {launcher._failures} restarts "
                        f"(--max-restarts {settings.max_restarts})"
                    )
                    status = exit_status(codes[lost[0]] or 0) if lost else 1
                    return self._give_up(status), self._report()
                launcher._failures += 1
                reason = f"{what} (restart {launcher._failures} of {settings.max_restarts})"
                go_on = bool(lost)
            elif launcher._version == self._join_version:
                reason = f"{len(self._ready)} ranks ready to join"
                go_on = True
            else:
                reason = "the hosts changed"
            limit = settings.reset_limit
            resets = self._index + launcher._resets_in_place
            if limit is not None and resets >= limit:
                say(f"{reason}; not recovering: --reset-limit {limit} reached")
                failed_codes = [exit_status(codes[i] or 0) for i in lost]
                return self._give_up(max(failed_codes, default=1)), self._report()
            launcher._resets_in_place += 1
            hosts, new_size = launcher._wait_for_slots(first=False)
            if launcher._signal is not None:
                continue
            try:
                check_local(hosts)
            except LaunchError as error:
                raise ElasticError(str(error)) from None
            with launcher._lock:
                launcher._note_hosts(hosts)
            self._form(hosts, new_size, reason, go_on)

    def _watch_waiting(self, names: list[str]) -> int | None:
        """Looks after the processes waiting to join: tells the ranks of those newly ready
        (a host notice: they meet in a new round at their next commit), and replaces one
        that ended before joining, which counts against ``--max-restarts``. Returns the
        status to give up with when that limit is reached, else None."""
        launcher = self._launcher
        settings = launcher._settings
        for ident in list(self._waiting):
            code = self._workers[ident].process.poll()
            if code is None:
                continue
            self._waiting.remove(ident)
            self._ready.discard(ident)
            what = (
                f"the process started for local rank {self._home[ident]} ended with status "
                f"{exit_status(code)} before it joined"
            )
            if launcher._failures >= settings.max_restarts:
                say(
                    f"{what}; giving up after {launcher._failures} restarts "
                    f"(--max-restarts {settings.max_restarts})"
                )
                return exit_status(code) or 1
            launcher._failures += 1
            say(f"{what} (restart {launcher._failures} of {settings.max_restarts}); starting "
                "another")
            self._start_waiting([self._home[ident]])
        ready = {
            ident for ident in self._waiting
            if f"{READY_PREFIX}{self._index}.{ident}" in names
        }
        if ready - self._ready:
            self._ready |= ready
            with launcher._lock:
                if launcher._announce(HOSTS_ADDED):
                    self._join_version = launcher._version
            say(
                f"{len(self._ready)} ranks started for lost slots are ready; they join at the "
                "ranks' next commit"
            )
        return None

    def _form(self, hosts: list[Host], size: int, reason: str, go_on: bool = False) -> None:
        """Makes the next round of ``size`` ranks: survivors first, then processes that
        waited to join, then new processes. With ``go_on`` (after a loss, or when waiting
        processes are ready), where ``--min-np`` allows the survivors to go on without the
        slots left to fill, the round is theirs and the ready ones alone, and new processes
        for those slots get ready to join a later one (slots added by a host change are
        filled at once)."""
        survivors = [i for i in self._members if self._workers[i].process.poll() is None]
        kept = survivors[:size]
        now = time.monotonic()
        for ident in survivors[size:]:
            self._workers[ident].left_out_at = now
        room = max(0, size - len(kept))
        waiting = [i for i in self._waiting if self._workers[i].process.poll() is None]
        for ident in waiting[room:]:  # slots were removed: they have no place to join
            self._workers[ident].process.kill()
        waiting = waiting[:room]
        ready = [i for i in waiting if i in self._ready]
        members = kept + ready
        smaller = (
            go_on
            and len(members) < size
            and len(members) >= self._launcher._settings.min_np
        )
        if not smaller:
            members += [i for i in waiting if i not in ready]  # they find this round
        joined = members[len(kept):]
        missing = size - len(members) - (len(waiting) - len(ready) if smaller else 0)
        self._round += 1
        self._formed_version = self._launcher._version
        self._waiting = [i for i in waiting if i not in members]
        self._ready &= set(self._waiting)
        started = [] if smaller else self._new_idents(missing)
        self._members = members + started
        homes = self._free_homes(size)
        for ident in started:
            self._home[ident] = homes.pop(0)
        self._assign_slots(len(self._members))
        port = free_port()
        variables = {
            ident: {
                **rank_variables(rank, len(self._members), port, self._slots[ident]),
                **self._versions(),
            }
            for rank, ident in enumerate(self._members)
        }
        record = {
            "launch": self._index,
            "round": self._round,
            "workers": {str(ident): values for ident, values in variables.items()},
        }
        self._write_round(record)
        self._clear_requests()
        if self._round > 0:
            counts = [f"{len(kept)} ranks kept"]
            if joined:
                counts.append(f"{len(joined)} joined")
            counts.append(f"{len(started)} started")
            if smaller:
                counts.append(f"{len(self._waiting) + missing} to join when ready")
            say(
                f"round {self._round}: {reason}; {', '.join(counts)}, on "
                f"{format_hosts(hosts)} ({len(self._members)} ranks)"
            )
        for ident in started:
            self._start(ident, variables[ident])
        if smaller:
            self._start_waiting(homes[:missing])

    def _new_idents(self, count: int) -> list[int]:
        idents = list(range(self._next_ident, self._next_ident + count))
        self._next_ident += count
        return idents

    def _free_homes(self, size: int) -> list[int]:
        """The local ranks below ``size`` that no member or waiting process started with:
        those a new process takes (the lost one's, so its GPU)."""
        taken = {self._home[i] for i in self._members + self._waiting if i in self._home}
        return [slot for slot in range(size) if slot not in taken]

    def _assign_slots(self, size: int) -> None:
        """Gives every member a local rank below ``size``: each keeps the one it started
        with where it can (a process keeps the GPU it chose by local rank at its start), the
        others take the free ones (only in a smaller round, or when slots were removed)."""
        self._slots = {}
        for ident in self._members:
            home = self._home[ident]
            if home < size and home not in self._slots.values():
                self._slots[ident] = home
        free = [slot for slot in range(size) if slot not in self._slots.values()]
        for ident in self._members:
            if ident not in self._slots:
                self._slots[ident] = free.pop(0)

    def _versions(self) -> dict[str, str]:
        return {"BAGUAHVD_ELASTIC_HOSTS_VERSION": str(self._launcher._version)}

    def _start_waiting(self, homes: list[int]) -> None:
        """Starts a process for each of the local ranks ``homes`` that waits in
        ``hvd.init()`` until a later round takes it."""
        for ident, home in zip(self._new_idents(len(homes)), homes):
            self._home[ident] = home
            self._waiting.append(ident)
            self._start(ident, {
                JOIN_ENV: "1",
                "LOCAL_RANK": str(home),
                "HOROVOD_LOCAL_RANK": str(home),
                **self._versions(),
            })

    def _start(self, ident: int, variables: dict[str, str]) -> None:
        env = dict(self._shared, **variables)
        env[WORKER_ENV] = str(ident)
        env[ROUND_ENV] = str(self._round)
        pipe = subprocess.PIPE if self._tag else None
        try:
            process = subprocess.Popen(
                list(self._launcher._args.command), env=env, start_new_session=True,
                stdout=pipe, stderr=subprocess.PIPE,
            )
        except OSError as error:
            raise ElasticError(f"cannot run {self._launcher._args.command[0]}: {error}") from None
        self._workers[ident] = _Worker(ident, process)
        streams: list[tuple[IO[bytes], IO[bytes], str]] = []
        if process.stdout is not None:
            streams.append((process.stdout, sys.stdout.buffer, "stdout"))
        assert process.stderr is not None
        streams.append((process.stderr, sys.stderr.buffer, "stderr"))
        for source, target, name in streams:
            prefix = f"[{self._home[ident]}]<{name}>:".encode() if self._tag else b""
            copier = threading.Thread(
                target=self._copy, args=(source, target, prefix, name == "stderr"), daemon=True
            )
            copier.start()
            self._copiers.append(copier)

    def _copy(self, source: IO[bytes], target: IO[bytes], prefix: bytes, keep: bool) -> None:
        for line in iter(source.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            stamp = time.strftime("[%a %b %d %H:%M:%S %Y]").encode() if self._timestamp else b""
            with self._lock:
                target.write(stamp + prefix + line)
                target.flush()
                if keep:
                    self._tail.append(line.decode(errors="replace"))
        source.close()

    def _report(self) -> str:
        with self._lock:
            return "".join(self._tail)

    # -- the folder ------------------------------------------------------------------------

    def _write_round(self, record: dict[str, object]) -> None:
        path = os.path.join(self._folder, ROUND_FILE)
        temporary = f"{path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                json.dump(record, handle)
            os.replace(temporary, path)
        except OSError as error:
            raise ElasticError(f"cannot write the round file {path}: {error.strerror}") from None

    def _folder_names(self) -> list[str]:
        try:
            return os.listdir(self._folder)
        except OSError:
            return []

    def _requested(self, names: list[str]) -> bool:
        prefix = f"{ROUND_REQUEST_PREFIX}{self._index}.{self._round}."
        return any(name.startswith(prefix) for name in names)

    def _clear_requests(self, everything: bool = False) -> None:
        """Removes the requests for rounds (all of them: a new round answers every one),
        and the readiness notices of processes no longer waiting (``everything``: all)."""
        waiting = () if everything else self._waiting
        keep = {f"{READY_PREFIX}{self._index}.{ident}" for ident in waiting}
        for name in self._folder_names():
            if name.startswith(ROUND_REQUEST_PREFIX) or (
                name.startswith(READY_PREFIX) and name not in keep
            ):
                try:
                    os.remove(os.path.join(self._folder, name))
                except OSError:
                    pass

    # -- ending ----------------------------------------------------------------------------

    def _stop_left_out(self) -> None:
        now = time.monotonic()
        for worker in self._workers.values():
            left = worker.left_out_at
            if left is not None and worker.process.poll() is None and now - left > GRACE_S:
                worker.process.kill()

    def _finish(self) -> int:
        """Waits for the members (see :func:`~baguahvd.runner.local_gloo.wait_all`) and
        returns their worst status."""
        status = wait_all([self._workers[i].process for i in self._members])
        self.stop_all()
        self._clear_requests(everything=True)
        for copier in self._copiers:
            copier.join(timeout=KILL_AFTER_S)
        return status

    def _give_up(self, status: int) -> int:
        """Ends the launch with ``status``: the survivors, which would wait for a round
        that never comes, are stopped at once."""
        for ident in self._members:
            process = self._workers[ident].process
            if process.poll() is None:
                process.terminate()
        self._finish()
        return status

    def stop_all(self) -> None:
        """Kills every process of the pool that still runs (those left out included)."""
        for worker in self._workers.values():
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()

    def signal_all(self, signum: int) -> None:
        for worker in self._workers.values():
            if worker.process.poll() is None:
                try:
                    worker.process.send_signal(signum)
                except ProcessLookupError:
                    pass
