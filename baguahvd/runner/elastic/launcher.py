"""The relaunch loop of ``baguahvdrun --elastic``: one ``mpirun`` child per launch.

Before each launch :class:`ElasticLauncher` reads the hosts again, waits for ``--min-np``
slots, and starts ``mpirun`` with the variables of :mod:`baguahvd.common.elastic_protocol`
(the shared folder, the launch index, the host set's version). While a launch runs it copies
``mpirun``'s stderr through unchanged, keeping its end to find failed nodes, polls the
discovery script and writes a changed host set to the notice file, and forwards SIGINT and
SIGTERM to the launch's process group. Its own messages go to stderr with a ``baguahvdrun:``
prefix.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType
from typing import IO, Any

from baguahvd.common.elastic_protocol import (
    ELASTIC_DIR_ENV,
    ELASTIC_ENV,
    HOSTS_NOTICE_FILE,
    HOSTS_VERSION_ENV,
    RESIZE_EXIT_CODE,
    RESTART_ENV,
    TRAINING_MARK_FILE,
)
from baguahvd.runner.elastic.discovery import discover_hosts, host_change
from baguahvd.runner.elastic.settings import (
    ElasticError,
    ElasticSettings,
    HostDiscoveryError,
    NotEnoughSlotsError,
    launch_size,
    say,
)
from baguahvd.runner.hosts import Host, LaunchError, format_hosts, parse_hostfile, same_host
from baguahvd.runner.mpirun import build_command

_STDERR_TAIL_LINES = 400
# Open MPI's reports of a dead rank or daemon, matched on stderr with runs of whitespace
# (line breaks included: Open MPI wraps its messages) folded into one space.
_FAILED_NODE_PATTERNS = (
    re.compile(r"\brank\s+\d+\s+(?:with\s+PID\s+\d+\s+)?on\s+node\s+(\S+)", re.IGNORECASE),
    re.compile(r"\bRemote\s+daemon:\s+\S+\s+on\s+node\s+(\S+)", re.IGNORECASE),
    re.compile(r"\bdaemon\s+on\s+node\s+(\S+)\s+(?:failed|died|exited)", re.IGNORECASE),
)

# Open MPI's reports of a program that no rank could start (a missing or non-executable
# file): relaunching cannot help.
_NOT_STARTED_PATTERNS = (
    re.compile(r"unable\s+to\s+launch\s+the\s+specified\s+application", re.IGNORECASE),
    re.compile(
        r"could\s+not\s+(?:access\s+or\s+)?(?:find|execute|access)\s+an\s+executable", re.IGNORECASE
    ),
)


def failed_nodes(stderr_text: str) -> list[str]:
    """Finds the nodes Open MPI reports as the place of a failed rank or daemon.

    Args:
        stderr_text: what ``mpirun`` wrote to stderr (or its end).

    Returns:
        The node names in the order first reported, without repeats; empty when nothing
        in the text looks like such a report.
    """
    text = " ".join(stderr_text.split())
    found: dict[str, None] = {}
    for pattern in _FAILED_NODE_PATTERNS:
        for match in pattern.finditer(text):
            name = match.group(1).rstrip(".,;:")
            if name:
                found[name] = None
    return list(found)


# The last line of a Python traceback: "ValueError: ...", "mod.CommitError: ...", maybe
# behind mpirun's output tag ("[1,0]<stderr>:").
_OUTPUT_TAG = re.compile(r"^\[[^\]]*\](?:<std\w+>)?:?\s*")
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$"
)


def last_exception(stderr_text: str) -> str | None:
    """Returns the last Python exception line (``Type: message``) in ``mpirun``'s stderr."""
    for raw in reversed(stderr_text.splitlines()):
        line = _OUTPUT_TAG.sub("", raw.strip())
        if _EXCEPTION_LINE.match(line):
            return line
    return None


def program_not_started(stderr_text: str) -> bool:
    """Whether ``mpirun``'s stderr says that the program could not be started at all."""
    text = " ".join(stderr_text.split())
    return any(pattern.search(text) for pattern in _NOT_STARTED_PATTERNS)


def _slot_map(hosts: Iterable[Host]) -> dict[str, int]:
    return {host.name: host.slots for host in hosts}


def _copy_stream(source: IO[bytes], tail: collections.deque[str]) -> None:
    """Copies ``mpirun``'s stderr to ours unchanged, keeping its last lines for scanning."""
    for line in iter(source.readline, b""):
        target = sys.stderr
        raw = getattr(target, "buffer", None)
        target.flush()
        if raw is not None:
            raw.write(line)
            raw.flush()
        else:
            target.write(line.decode(errors="replace"))
            target.flush()
        tail.append(line.decode(errors="replace"))
    source.close()


class ElasticLauncher:
    """Runs one elastic job: launches ``mpirun`` until the job succeeds or gives up.

    It owns the host source, the launch, restart and relaunch counters, the blacklist and,
    while a launch runs, the thread polling the discovery script. Create one per job and
    call :meth:`run` from the main thread (it handles SIGINT and SIGTERM there).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        settings: ElasticSettings,
        env: Mapping[str, str],
        *,
        mpirun: str,
        open_mpi_major: int | None = None,
    ) -> None:
        """Prepares the job; nothing is started.

        Args:
            args: the parsed command line of ``baguahvdrun``.
            settings: the checked elastic settings of ``args``.
            env: the environment the ranks inherit (the launcher's).
            mpirun: the ``mpirun`` executable.
            open_mpi_major: Open MPI's major version, for
                :func:`baguahvd.runner.mpirun.build_command`.
        """
        self._args = args
        self._settings = settings
        self._env = dict(env)
        self._mpirun = mpirun
        self._open_mpi_major = open_mpi_major
        self._directory = ""
        self._lock = threading.Lock()
        self._discovered: list[Host] = []
        self._known: list[Host] = []
        self._version = 0
        self._blacklist: dict[str, float] = {}
        self._stop = threading.Event()
        self._signal: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        # Failures recovered so far (against --max-restarts), and resets done inside a
        # launch (against --reset-limit, with the relaunches).
        self._failures = 0
        self._resets_in_place = 0

    def run(self) -> int:
        """Runs the job to its end.

        Returns:
            0 when a launch succeeded; otherwise the status of the last launch, 1 when the
            job could not be (re)launched, or ``128 + signal`` after SIGINT or SIGTERM.
        """
        previous = self._install_signal_handlers()
        status = 1
        try:
            self._prepare_directory()
            if self._settings.discovery_script is None and self._args.slots_per_host:
                say("warning: --slots-per-host applies to --host-discovery-script only")
            status = self._loop()
        except ElasticError as error:
            say(f"error: {error}")
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        self._finish_directory(status)
        return status

    # --- the loop -------------------------------------------------------------------------

    def _loop(self) -> int:
        settings = self._settings
        self._refresh_hosts(strict=True)
        launches = 0
        reason = ""
        startup_error: str | None = None  # the previous launch's, if it failed starting up
        while True:
            hosts, size = self._wait_for_slots(first=launches == 0)
            if self._signal is not None:
                return 128 + self._signal
            if launches == 0:
                self._known = hosts
            else:
                self._note_hosts(hosts)
            launches += 1
            say(f"launch {launches}{reason} on {format_hosts(hosts)} ({size} ranks)")
            self._clear_training_mark()
            status, report = self._launch_once(launches - 1, hosts, size)
            if self._signal is not None:
                return status if status > 0 else 128 + self._signal
            if status == 0:
                return 0
            error = None if self._training_started() else last_exception(report)
            if status != RESIZE_EXIT_CODE and error is not None and error == startup_error:
                say(
                    f"launch {launches} failed with status {status} before any rank started "
                    f"training, with the same error as the launch before: {error}; "
                    "not relaunching"
                )
                return status
            startup_error = error
            what = (
                f"stopped for a host change (status {status})"
                if status == RESIZE_EXIT_CODE
                else f"failed with status {status}"
            )
            limit = settings.reset_limit
            if limit is not None and launches - 1 + self._resets_in_place >= limit:
                say(f"launch {launches} {what}; not relaunching: --reset-limit {limit} reached")
                return status
            if status != RESIZE_EXIT_CODE and program_not_started(report):
                say(
                    f"launch {launches} {what}: mpirun could not start the program; not relaunching"
                )
                return status
            if status == RESIZE_EXIT_CODE:
                say(f"launch {launches} {what}; relaunching on the new hosts")
                reason = " (hosts changed)"
            else:
                if self._failures >= settings.max_restarts:
                    say(
                        f"launch {launches} {what}; giving up after {self._failures} restarts "
                        f"(--max-restarts {settings.max_restarts})"
                    )
                    return status
                self._failures += 1
                say(
                    f"launch {launches} {what}; relaunching "
                    f"(restart {self._failures} of {settings.max_restarts})"
                )
                reason = f" (restart {self._failures} of {settings.max_restarts})"
                self._leave_out(failed_nodes(report))
            self._refresh_hosts(strict=False)

    def _wait_for_slots(self, *, first: bool) -> tuple[list[Host], int]:
        settings = self._settings
        deadline = time.monotonic() + settings.timeout
        waiting = False
        while True:
            hosts = self._usable(self._discovered)
            total = sum(host.slots for host in hosts)
            size = launch_size(
                total,
                first=first,
                num_proc=settings.num_proc,
                min_np=settings.min_np,
                max_np=settings.max_np,
            )
            if size is not None or self._signal is not None:
                return hosts, size or 0
            left_out = self._left_out_text()
            available = f"{total} available ({format_hosts(hosts)}{left_out})"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NotEnoughSlotsError(
                    f"{settings.min_np_flag} needs at least {settings.min_np} slots but only "
                    f"{available} after waiting {settings.timeout:g} s (--elastic-timeout); "
                    "add hosts, lower --min-np or raise --elastic-timeout"
                )
            if not waiting:
                say(
                    f"waiting up to {settings.timeout:g} s for {settings.min_np} slots; {available}"
                )
                waiting = True
            self._stop.wait(min(settings.poll_seconds, remaining))
            self._refresh_hosts(strict=False)

    def _launch_once(self, index: int, hosts: list[Host], size: int) -> tuple[int, str]:
        """Runs one launch; returns mpirun's status and the end of its stderr."""
        env = dict(self._env)
        env[ELASTIC_ENV] = "1"
        if "BAGUAHVD_ELASTIC" in env:
            env["BAGUAHVD_ELASTIC"] = "1"
        env[ELASTIC_DIR_ENV] = self._directory
        env[RESTART_ENV] = str(index)
        env[HOSTS_VERSION_ENV] = str(self._version)
        sys.stdout.flush()
        poller: threading.Thread | None = None
        poller_stop = threading.Event()
        if self._settings.discovery_script is not None:
            poller = threading.Thread(
                target=self._poll_hosts, args=(poller_stop,), name="baguahvd-discovery"
            )
            poller.daemon = True
            poller.start()
        try:
            return self._run_launch(index, hosts, size, env)
        finally:
            poller_stop.set()
            if poller is not None:
                poller.join()

    def _run_launch(
        self, index: int, hosts: list[Host], size: int, env: dict[str, str]
    ) -> tuple[int, str]:
        """Runs launch ``index`` of ``size`` ranks on ``hosts``, whose ranks inherit
        ``env``; returns its status and the end of its stderr."""
        try:
            command, child_env = build_command(
                self._args,
                env,
                mpirun=self._mpirun,
                open_mpi_major=self._open_mpi_major,
                hosts=hosts,
                num_proc=size,
            )
        except LaunchError as error:
            raise ElasticError(str(error)) from None
        if self._args.verbose:
            say(shlex.join(command))
        sys.stdout.flush()
        return self._run_mpirun(command, child_env)

    def _run_mpirun(self, command: list[str], env: dict[str, str]) -> tuple[int, str]:
        tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        try:
            process = subprocess.Popen(
                command, env=env, stderr=subprocess.PIPE, start_new_session=True
            )
        except OSError as error:
            raise ElasticError(f"cannot run {command[0]}: {error}") from None
        assert process.stderr is not None
        copier = threading.Thread(
            target=_copy_stream, args=(process.stderr, tail), name="baguahvd-stderr"
        )
        copier.daemon = True
        copier.start()
        self._process = process
        if self._signal is not None:  # arrived while starting
            self._forward(self._signal)
        try:
            status = process.wait()
        finally:
            self._process = None
            copier.join()
        if status < 0:
            status = 128 - status
        return status, "".join(tail)

    # --- hosts ----------------------------------------------------------------------------

    def _read_hosts(self) -> list[Host]:
        settings = self._settings
        if settings.fixed_hosts is not None:
            return list(settings.fixed_hosts)
        if settings.hostfile is not None:
            try:
                return parse_hostfile(settings.hostfile)
            except LaunchError as error:
                raise HostDiscoveryError(str(error)) from None
        assert settings.discovery_script is not None
        return discover_hosts(settings.discovery_script, settings.slots_per_host)

    def _refresh_hosts(self, *, strict: bool) -> None:
        """Reads the hosts again; a failure is an error only when ``strict``."""
        try:
            hosts = self._read_hosts()
        except HostDiscoveryError as error:
            if strict:
                raise
            say(f"warning: {error}; keeping the hosts {format_hosts(self._discovered)}")
            return
        with self._lock:
            self._discovered = hosts

    def _poll_hosts(self, stop: threading.Event) -> None:
        while not stop.wait(self._settings.poll_seconds):
            try:
                hosts = self._read_hosts()
            except HostDiscoveryError as error:
                say(f"warning: {error}; keeping the hosts {format_hosts(self._discovered)}")
                continue
            with self._lock:
                if stop.is_set():
                    return
                self._discovered = hosts
                self._note_hosts(self._usable(hosts))

    def _note_hosts(self, hosts: list[Host]) -> None:
        """Makes ``hosts`` the current host set, announcing it to the ranks if it changed."""
        if _slot_map(hosts) == _slot_map(self._known):
            return
        result = host_change(self._known, hosts)
        self._known = list(hosts)
        if self._announce(result):
            say(f"hosts {result}: now {format_hosts(hosts)} (hosts version {self._version})")

    def _announce(self, result: str) -> bool:
        """Writes a notice of the next host set version, the current hosts and ``result``
        (one of :mod:`~baguahvd.common.elastic_protocol`'s ``HOSTS_*``); the ranks act on
        it at their next commit. Returns False, after a warning, when it cannot be written
        (the version counts all the same). Call it with ``_lock`` held."""
        self._version += 1
        notice = {
            "version": self._version,
            "hosts": [[host.name, host.slots] for host in self._known],
            "result": result,
        }
        path = os.path.join(self._directory, HOSTS_NOTICE_FILE)
        temporary = f"{path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                json.dump(notice, handle)
            os.replace(temporary, path)
        except OSError as error:
            say(f"warning: cannot write the host notice {path}: {error.strerror}")
            return False
        return True

    def _usable(self, hosts: Sequence[Host]) -> list[Host]:
        now = time.monotonic()
        for name, until in list(self._blacklist.items()):
            if until <= now:
                del self._blacklist[name]
        return [
            host
            for host in hosts
            if not any(same_host(host.name, name) for name in self._blacklist)
        ]

    def _leave_out(self, nodes: Sequence[str]) -> None:
        cooldown = self._settings.cooldown
        if cooldown is None or not nodes:
            return
        for node in nodes:
            seconds = random.uniform(*cooldown)
            self._blacklist[node] = time.monotonic() + seconds
            say(f"leaving host {node} out for {seconds:.1f} s (--blacklist-cooldown-range)")

    def _left_out_text(self) -> str:
        if not self._blacklist:
            return ""
        return "; left out for now: " + ", ".join(sorted(self._blacklist))

    # --- the folder -----------------------------------------------------------------------

    def _prepare_directory(self) -> None:
        if self._settings.checkpoint_dir is not None:
            directory = os.path.abspath(self._settings.checkpoint_dir)
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as error:
                raise ElasticError(
                    f"cannot create --checkpoint-dir {directory!r}: {error.strerror}"
                ) from None
        else:
            directory = tempfile.mkdtemp(prefix="baguahvd-elastic-")
        self._directory = directory
        # A notice left by an earlier job would stop this job's first launch at once.
        try:
            os.remove(os.path.join(directory, HOSTS_NOTICE_FILE))
        except FileNotFoundError:
            pass
        except OSError as error:
            raise ElasticError(
                f"cannot remove the old host notice in {directory!r}: {error.strerror}"
            ) from None

    def _clear_training_mark(self) -> None:
        try:
            os.remove(os.path.join(self._directory, TRAINING_MARK_FILE))
        except FileNotFoundError:
            pass

    def _training_started(self) -> bool:
        return os.path.exists(os.path.join(self._directory, TRAINING_MARK_FILE))

    def _finish_directory(self, status: int) -> None:
        if not self._directory or self._settings.checkpoint_dir is not None:
            return
        if status == 0:
            shutil.rmtree(self._directory, ignore_errors=True)
        else:
            say(
                f"kept the job's elastic state in {self._directory}; resume from it with "
                f"--checkpoint-dir {self._directory}"
            )

    # --- signals --------------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, self._on_signal)
        return previous

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum
        self._stop.set()
        self._forward(signum)

    def _forward(self, signum: int) -> None:
        process = self._process
        if process is None:
            return
        try:
            os.killpg(process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
