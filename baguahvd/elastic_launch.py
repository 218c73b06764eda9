"""``baguahvdrun --elastic``: run the job again after a failure or a host change.

An elastic job is a loop of ordinary ``mpirun`` launches. Every rank of every launch learns
where to commit its state and which launch it belongs to from the variables of
:mod:`baguahvd.common.elastic_protocol`, so a relaunched job resumes from its last commit.
The loop ends when a launch succeeds; a launch that fails is started again while
``--max-restarts`` allows, and one whose ranks stopped because the host set changed
(status :data:`~baguahvd.common.elastic_protocol.RESIZE_EXIT_CODE`) is started again at
once on the new hosts. ``--reset-limit`` bounds the relaunches of both kinds.

The hosts come from ``-H`` (fixed), ``--hostfile`` (read again before every launch) or
``--host-discovery-script`` (run before every launch, and every second while one runs; a
change is announced to the ranks in the notice file). Unlike ``horovodrun``, which leaves a
failed host out for good, a host is left out only with ``--blacklist-cooldown-range``, and
then for a while: relaunching on the same hosts is the normal way to recover here.

The launcher's own messages go to stderr with a ``baguahvdrun:`` prefix, like those of
:mod:`baguahvd.run`.
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
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any

from baguahvd import run as cli
from baguahvd.common.elastic_protocol import (
    ELASTIC_DIR_ENV,
    ELASTIC_ENV,
    HOSTS_ADDED,
    HOSTS_MIXED,
    HOSTS_NOTICE_FILE,
    HOSTS_REMOVED,
    HOSTS_VERSION_ENV,
    RESIZE_EXIT_CODE,
    RESTART_ENV,
)

POLL_SECONDS_ENV = "BAGUAHVD_ELASTIC_POLL_SECONDS"
"""Launcher setting: seconds between two runs of the discovery script (default 1)."""
DEFAULT_MAX_RESTARTS = 3
DEFAULT_ELASTIC_TIMEOUT = 600.0
DISCOVERY_TIMEOUT_SECONDS = 30.0
"""How long one run of ``--host-discovery-script`` may take."""
_STDERR_TAIL_LINES = 400
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
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

ELASTIC_ONLY_FLAGS = (
    ("checkpoint_dir", "--checkpoint-dir"),
    ("min_num_proc", "--min-np"),
    ("max_num_proc", "--max-np"),
    ("slots_per_host", "--slots-per-host"),
    ("elastic_timeout", "--elastic-timeout"),
    ("reset_limit", "--reset-limit"),
    ("blacklist_cooldown_range", "--blacklist-cooldown-range"),
    ("max_restarts", "--max-restarts"),
)
"""``(attribute, flag)`` of the options that only mean something with ``--elastic``."""


class ElasticError(RuntimeError):
    """The elastic job cannot go on; the message says why and what to change."""


class HostDiscoveryError(ElasticError):
    """The host file or discovery script did not give a usable host list."""


class NotEnoughSlotsError(ElasticError):
    """Fewer slots than ``--min-np`` stayed available for ``--elastic-timeout`` seconds."""


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the command line asks for an elastic job.

    Args:
        args: the parsed command line of ``baguahvdrun``.

    Returns:
        True with ``--elastic`` or ``--host-discovery-script`` (which implies it).
    """
    return bool(args.elastic or args.host_discovery_script is not None)


def check_elastic_flags(args: argparse.Namespace) -> None:
    """Rejects the elastic-only flags of a job that is not elastic.

    Args:
        args: the parsed command line of ``baguahvdrun``.

    Raises:
        LaunchError: such a flag was given without ``--elastic``; the message names it.
    """
    if is_elastic(args):
        return
    for attribute, flag in ELASTIC_ONLY_FLAGS:
        if getattr(args, attribute, None) is not None:
            raise cli.LaunchError(
                f"{flag} only applies to elastic jobs; add --elastic (or --host-discovery-script)"
            )


@dataclass(frozen=True)
class ElasticSettings:
    """What an elastic job was asked for, checked. Build it with :meth:`from_args`."""

    fixed_hosts: tuple[cli.Host, ...] | None
    """The hosts of every launch (``-H``, or ``localhost:<np>``); ``None`` when they are read
    from :attr:`hostfile` or :attr:`discovery_script`."""
    hostfile: str | None
    """``--hostfile``, read again before every launch."""
    discovery_script: str | None
    """``--host-discovery-script``, run before every launch and polled during one."""
    num_proc: int | None
    """``-np``: ranks of the first launch (default: every slot, up to :attr:`max_np`)."""
    min_np: int
    """Fewest ranks a launch may have (``--min-np``, default ``-np``, else 1)."""
    min_np_flag: str
    """The flag :attr:`min_np` came from, for messages."""
    max_np: int | None
    """Most ranks a launch may have (``--max-np``); ``None`` for no limit."""
    slots_per_host: int
    """Slots of a discovered host printed without ``:slots`` (``--slots-per-host``)."""
    max_restarts: int
    """Relaunches after failures before giving up (``--max-restarts``)."""
    reset_limit: int | None
    """Relaunches of any kind before giving up (``--reset-limit``); ``None``: no limit."""
    timeout: float
    """Seconds to wait for :attr:`min_np` slots before failing (``--elastic-timeout``)."""
    cooldown: tuple[float, float] | None
    """``--blacklist-cooldown-range``: bounds of the random time a host whose rank failed
    is left out; ``None`` leaves no host out."""
    checkpoint_dir: str | None
    """``--checkpoint-dir``, kept at the end; ``None`` for a temporary folder."""
    poll_seconds: float
    """Seconds between two runs of the discovery script (``BAGUAHVD_ELASTIC_POLL_SECONDS``)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> ElasticSettings:
        """Checks the elastic command line.

        Args:
            args: the parsed command line of ``baguahvdrun``.
            env: the launcher's environment (for ``BAGUAHVD_ELASTIC_POLL_SECONDS``).

        Returns:
            The settings.

        Raises:
            LaunchError: a flag is out of range or the flags contradict each other.
        """
        cli.check_request(args)
        script = args.host_discovery_script
        if script is not None and (args.hosts is not None or args.hostfile is not None):
            raise cli.LaunchError(
                "--host-discovery-script replaces -H/--hosts and --hostfile; give only one"
            )
        for attribute, flag, lowest in (
            ("min_num_proc", "--min-np", 1),
            ("max_num_proc", "--max-np", 1),
            ("slots_per_host", "--slots-per-host", 1),
            ("max_restarts", "--max-restarts", 0),
            ("reset_limit", "--reset-limit", 0),
        ):
            value = getattr(args, attribute)
            if value is not None and value < lowest:
                raise cli.LaunchError(f"{flag} must be at least {lowest}, got {value}")
        num_proc, min_np, max_np = args.num_proc, args.min_num_proc, args.max_num_proc
        if min_np is not None and max_np is not None and min_np > max_np:
            raise cli.LaunchError(f"--min-np {min_np} is larger than --max-np {max_np}")
        if num_proc is not None and min_np is not None and num_proc < min_np:
            raise cli.LaunchError(f"-np {num_proc} is smaller than --min-np {min_np}")
        if num_proc is not None and max_np is not None and num_proc > max_np:
            raise cli.LaunchError(f"-np {num_proc} is larger than --max-np {max_np}")
        timeout = DEFAULT_ELASTIC_TIMEOUT if args.elastic_timeout is None else args.elastic_timeout
        if timeout < 0:
            raise cli.LaunchError(f"--elastic-timeout must not be negative, got {timeout:g}")
        cooldown: tuple[float, float] | None = None
        if args.blacklist_cooldown_range is not None:
            low, high = args.blacklist_cooldown_range
            if not 0 <= low <= high:
                raise cli.LaunchError(
                    f"--blacklist-cooldown-range {low:g} {high:g}: need 0 <= MIN <= MAX"
                )
            cooldown = (float(low), float(high))

        fixed_hosts: tuple[cli.Host, ...] | None = None
        if args.hosts is not None:
            fixed_hosts = tuple(cli.parse_hosts(args.hosts))
        elif args.hostfile is None and script is None:
            if num_proc is None:
                raise cli.LaunchError(
                    "-np/--num-proc is required (or give -H/--hosts, --hostfile or "
                    "--host-discovery-script)"
                )
            fixed_hosts = (cli.Host("localhost", num_proc),)
        if fixed_hosts is not None and num_proc is not None:
            total = sum(host.slots for host in fixed_hosts)
            if total < num_proc:
                raise cli.LaunchError(
                    f"-np {num_proc} needs {num_proc} slots but the hosts provide only "
                    f"{total} ({format_hosts(fixed_hosts)}); give more slots or a smaller -np"
                )

        poll_text = env.get(POLL_SECONDS_ENV, "").strip()
        try:
            poll_seconds = float(poll_text) if poll_text else 1.0
        except ValueError:
            poll_seconds = -1.0
        if not poll_seconds > 0:
            raise cli.LaunchError(f"{POLL_SECONDS_ENV}={poll_text!r} is not a positive number")

        if min_np is not None:
            min_flag = f"--min-np {min_np}"
        elif num_proc is not None:
            min_flag = f"-np {num_proc}"
        else:
            min_flag = "a launch"
        return cls(
            fixed_hosts=fixed_hosts,
            hostfile=args.hostfile,
            discovery_script=script,
            num_proc=num_proc,
            min_np=min_np if min_np is not None else (num_proc or 1),
            min_np_flag=min_flag,
            max_np=max_np,
            slots_per_host=1 if args.slots_per_host is None else args.slots_per_host,
            max_restarts=(DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts),
            reset_limit=args.reset_limit,
            timeout=float(timeout),
            cooldown=cooldown,
            checkpoint_dir=args.checkpoint_dir,
            poll_seconds=poll_seconds,
        )


def format_hosts(hosts: Iterable[cli.Host]) -> str:
    """Writes hosts as ``-H`` takes them (``a:2,b:1``), or ``no hosts``."""
    return ",".join(f"{host.name}:{host.slots}" for host in hosts) or "no hosts"


def parse_discovered_hosts(text: str, slots_per_host: int, where: str) -> list[cli.Host]:
    """Parses a discovery script's output: one ``host`` or ``host:slots`` per line.

    Args:
        text: the script's standard output; blank lines are skipped.
        slots_per_host: slots of a host printed without ``:slots``.
        where: names the script in error messages.

    Returns:
        The hosts in order, with repeated names merged (their slots added up).

    Raises:
        HostDiscoveryError: a line is not a host name with optional positive slots.
    """
    slots: dict[str, int] = {}
    for line in text.splitlines():
        entry = line.strip()
        if not entry:
            continue
        name, count = entry, slots_per_host
        head, sep, tail = entry.rpartition(":")
        if sep and tail.strip().isdigit():
            name, count = head.strip(), int(tail)
        if not _HOST_NAME.fullmatch(name) or count < 1:
            raise HostDiscoveryError(
                f"{where} printed {line!r}; expected one 'host' or 'host:slots' per line"
            )
        slots[name] = slots.get(name, 0) + count
    return [cli.Host(name, count) for name, count in slots.items()]


def discover_hosts(script: str, slots_per_host: int) -> list[cli.Host]:
    """Runs the discovery script once and parses what it prints.

    Args:
        script: the executable (``--host-discovery-script``).
        slots_per_host: slots of a host printed without ``:slots``.

    Returns:
        The hosts it printed.

    Raises:
        HostDiscoveryError: the script cannot be run, fails, takes longer than
            :data:`DISCOVERY_TIMEOUT_SECONDS`, or prints something else than hosts.
    """
    where = f"--host-discovery-script {script!r}"
    try:
        answer = subprocess.run(
            [script],
            capture_output=True,
            text=True,
            timeout=DISCOVERY_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise HostDiscoveryError(
            f"{where} did not finish within {DISCOVERY_TIMEOUT_SECONDS:g} s"
        ) from None
    except OSError as error:
        raise HostDiscoveryError(
            f"cannot run {where}: {error.strerror}; it must be an executable file"
        ) from None
    if answer.returncode != 0:
        lines = [line for line in answer.stderr.splitlines() if line.strip()]
        detail = f": {lines[-1].strip()}" if lines else ""
        raise HostDiscoveryError(f"{where} exited with status {answer.returncode}{detail}")
    return parse_discovered_hosts(answer.stdout, slots_per_host, where)


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


def program_not_started(stderr_text: str) -> bool:
    """Whether ``mpirun``'s stderr says that the program could not be started at all."""
    text = " ".join(stderr_text.split())
    return any(pattern.search(text) for pattern in _NOT_STARTED_PATTERNS)


def same_host(first: str, second: str) -> bool:
    """Whether two names mean the same machine: equal, equal before the first dot, or both
    this machine (Open MPI reports ``localhost`` under the machine's own name)."""
    if first == second or first.split(".", 1)[0] == second.split(".", 1)[0]:
        return True
    return cli._is_local(first) and cli._is_local(second)


def host_change(old: Sequence[cli.Host], new: Sequence[cli.Host]) -> str:
    """Describes a host-set change as the notice's ``result``.

    Args:
        old: the hosts before.
        new: the hosts after; differs from ``old``.

    Returns:
        ``"added"`` when only hosts or slots were added, ``"removed"`` when only some were
        removed, ``"mixed"`` otherwise.
    """
    before = {host.name: host.slots for host in old}
    after = {host.name: host.slots for host in new}
    grew = any(slots > before.get(name, 0) for name, slots in after.items())
    shrank = any(slots > after.get(name, 0) for name, slots in before.items())
    if grew and not shrank:
        return HOSTS_ADDED
    if shrank and not grew:
        return HOSTS_REMOVED
    return HOSTS_MIXED


def launch_size(
    total_slots: int, *, first: bool, num_proc: int | None, min_np: int, max_np: int | None
) -> int | None:
    """Chooses the number of ranks of a launch.

    Args:
        total_slots: slots of the hosts available now.
        first: whether this is the job's first launch, which honours ``-np``.
        num_proc: ``-np``, or ``None``.
        min_np: the fewest ranks allowed.
        max_np: the most ranks allowed, or ``None``.

    Returns:
        The number of ranks, or ``None`` while fewer than ``min_np`` slots are available.
    """
    if total_slots < min_np:
        return None
    size = total_slots
    if first and num_proc is not None:
        size = min(num_proc, size)
    if max_np is not None:
        size = min(size, max_np)
    return max(size, min_np)


def _slot_map(hosts: Iterable[cli.Host]) -> dict[str, int]:
    return {host.name: host.slots for host in hosts}


def _say(message: str) -> None:
    print(f"baguahvdrun: {message}", file=sys.stderr, flush=True)


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
            open_mpi_major: Open MPI's major version, for :func:`baguahvd.run.build_command`.
        """
        self._args = args
        self._settings = settings
        self._env = dict(env)
        self._mpirun = mpirun
        self._open_mpi_major = open_mpi_major
        self._directory = ""
        self._lock = threading.Lock()
        self._discovered: list[cli.Host] = []
        self._known: list[cli.Host] = []
        self._version = 0
        self._blacklist: dict[str, float] = {}
        self._stop = threading.Event()
        self._signal: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

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
                _say("warning: --slots-per-host applies to --host-discovery-script only")
            status = self._loop()
        except ElasticError as error:
            _say(f"error: {error}")
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
        failures = 0
        reason = ""
        while True:
            hosts, size = self._wait_for_slots(first=launches == 0)
            if self._signal is not None:
                return 128 + self._signal
            if launches == 0:
                self._known = hosts
            else:
                self._note_hosts(hosts)
            launches += 1
            _say(f"launch {launches}{reason} on {format_hosts(hosts)} ({size} ranks)")
            status, report = self._launch_once(launches - 1, hosts, size)
            if self._signal is not None:
                return status if status > 0 else 128 + self._signal
            if status == 0:
                return 0
            what = (
                f"stopped for a host change (status {status})"
                if status == RESIZE_EXIT_CODE
                else f"failed with status {status}"
            )
            limit = settings.reset_limit
            if limit is not None and launches - 1 >= limit:
                _say(f"launch {launches} {what}; not relaunching: --reset-limit {limit} reached")
                return status
            if status != RESIZE_EXIT_CODE and program_not_started(report):
                _say(
                    f"launch {launches} {what}: mpirun could not start the program; not relaunching"
                )
                return status
            if status == RESIZE_EXIT_CODE:
                _say(f"launch {launches} {what}; relaunching on the new hosts")
                reason = " (hosts changed)"
            else:
                if failures >= settings.max_restarts:
                    _say(
                        f"launch {launches} {what}; giving up after {failures} restarts "
                        f"(--max-restarts {settings.max_restarts})"
                    )
                    return status
                failures += 1
                _say(
                    f"launch {launches} {what}; relaunching "
                    f"(restart {failures} of {settings.max_restarts})"
                )
                reason = f" (restart {failures} of {settings.max_restarts})"
                self._leave_out(failed_nodes(report))
            self._refresh_hosts(strict=False)

    def _wait_for_slots(self, *, first: bool) -> tuple[list[cli.Host], int]:
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
                _say(
                    f"waiting up to {settings.timeout:g} s for {settings.min_np} slots; {available}"
                )
                waiting = True
            self._stop.wait(min(settings.poll_seconds, remaining))
            self._refresh_hosts(strict=False)

    def _launch_once(self, index: int, hosts: list[cli.Host], size: int) -> tuple[int, str]:
        """Runs one launch; returns mpirun's status and the end of its stderr."""
        env = dict(self._env)
        env[ELASTIC_ENV] = "1"
        if "BAGUAHVD_ELASTIC" in env:
            env["BAGUAHVD_ELASTIC"] = "1"
        env[ELASTIC_DIR_ENV] = self._directory
        env[RESTART_ENV] = str(index)
        env[HOSTS_VERSION_ENV] = str(self._version)
        try:
            command, child_env = cli.build_command(
                self._args,
                env,
                mpirun=self._mpirun,
                open_mpi_major=self._open_mpi_major,
                hosts=hosts,
                num_proc=size,
            )
        except cli.LaunchError as error:
            raise ElasticError(str(error)) from None
        if self._args.verbose:
            _say(shlex.join(command))
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
            return self._run_mpirun(command, child_env)
        finally:
            poller_stop.set()
            if poller is not None:
                poller.join()

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

    def _read_hosts(self) -> list[cli.Host]:
        settings = self._settings
        if settings.fixed_hosts is not None:
            return list(settings.fixed_hosts)
        if settings.hostfile is not None:
            try:
                return cli.parse_hostfile(settings.hostfile)
            except cli.LaunchError as error:
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
            _say(f"warning: {error}; keeping the hosts {format_hosts(self._discovered)}")
            return
        with self._lock:
            self._discovered = hosts

    def _poll_hosts(self, stop: threading.Event) -> None:
        while not stop.wait(self._settings.poll_seconds):
            try:
                hosts = self._read_hosts()
            except HostDiscoveryError as error:
                _say(f"warning: {error}; keeping the hosts {format_hosts(self._discovered)}")
                continue
            with self._lock:
                if stop.is_set():
                    return
                self._discovered = hosts
                self._note_hosts(self._usable(hosts))

    def _note_hosts(self, hosts: list[cli.Host]) -> None:
        """Makes ``hosts`` the current host set, announcing it to the ranks if it changed."""
        if _slot_map(hosts) == _slot_map(self._known):
            return
        result = host_change(self._known, hosts)
        self._version += 1
        self._known = list(hosts)
        notice = {
            "version": self._version,
            "hosts": [[host.name, host.slots] for host in hosts],
            "result": result,
        }
        path = os.path.join(self._directory, HOSTS_NOTICE_FILE)
        temporary = f"{path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                json.dump(notice, handle)
            os.replace(temporary, path)
        except OSError as error:
            _say(f"warning: cannot write the host notice {path}: {error.strerror}")
            return
        _say(f"hosts {result}: now {format_hosts(hosts)} (hosts version {self._version})")

    def _usable(self, hosts: Sequence[cli.Host]) -> list[cli.Host]:
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
            _say(f"leaving host {node} out for {seconds:.1f} s (--blacklist-cooldown-range)")

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

    def _finish_directory(self, status: int) -> None:
        if not self._directory or self._settings.checkpoint_dir is not None:
            return
        if status == 0:
            shutil.rmtree(self._directory, ignore_errors=True)
        else:
            _say(
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
