"""What an elastic job was asked for: the checked elastic flags, and the errors that end it.

:class:`ElasticSettings` checks the elastic part of ``baguahvdrun``'s command line once,
before anything is started; :func:`launch_size` is the rule that turns the slots available
before a launch into its number of ranks (``-np`` for the first launch, then every slot,
within ``--min-np``/``--max-np``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from baguahvd.runner.allocation import detect_allocation
from baguahvd.runner.hosts import Host, LaunchError, format_hosts, parse_hosts
from baguahvd.runner.mpirun import check_request

POLL_SECONDS_ENV = "BAGUAHVD_ELASTIC_POLL_SECONDS"
"""Launcher setting: seconds between two runs of the discovery script (default 1)."""
DEFAULT_MAX_RESTARTS = 3
DEFAULT_ELASTIC_TIMEOUT = 600.0


def say(message: str) -> None:
    """Writes one of the launcher's own messages to stderr, with the ``baguahvdrun:``
    prefix."""
    print(f"baguahvdrun: {message}", file=sys.stderr, flush=True)


class ElasticError(RuntimeError):
    """The elastic job cannot go on; the message says why and what to change."""


class HostDiscoveryError(ElasticError):
    """The host file or discovery script did not give a usable host list."""


class NotEnoughSlotsError(ElasticError):
    """Fewer slots than ``--min-np`` stayed available for ``--elastic-timeout`` seconds."""


@dataclass(frozen=True)
class ElasticSettings:
    """What an elastic job was asked for, checked. Build it with :meth:`from_args`."""

    fixed_hosts: tuple[Host, ...] | None
    """The hosts of every launch (``-H``, the job's allocation, or ``localhost:<np>``);
    ``None`` when they are read from :attr:`hostfile` or :attr:`discovery_script`."""
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
            env: the launcher's environment (for ``BAGUAHVD_ELASTIC_POLL_SECONDS`` and the
                job's allocation).

        Returns:
            The settings.

        Raises:
            LaunchError: a flag is out of range or the flags contradict each other.
        """
        check_request(args)
        script = args.host_discovery_script
        if script is not None and (args.hosts is not None or args.hostfile is not None):
            raise LaunchError(
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
                raise LaunchError(f"{flag} must be at least {lowest}, got {value}")
        num_proc, min_np, max_np = args.num_proc, args.min_num_proc, args.max_num_proc
        if min_np is not None and max_np is not None and min_np > max_np:
            raise LaunchError(f"--min-np {min_np} is larger than --max-np {max_np}")
        if num_proc is not None and min_np is not None and num_proc < min_np:
            raise LaunchError(f"-np {num_proc} is smaller than --min-np {min_np}")
        if num_proc is not None and max_np is not None and num_proc > max_np:
            raise LaunchError(f"-np {num_proc} is larger than --max-np {max_np}")
        timeout = DEFAULT_ELASTIC_TIMEOUT if args.elastic_timeout is None else args.elastic_timeout
        if timeout < 0:
            raise LaunchError(f"--elastic-timeout must not be negative, got {timeout:g}")
        cooldown: tuple[float, float] | None = None
        if args.blacklist_cooldown_range is not None:
            low, high = args.blacklist_cooldown_range
            if not 0 <= low <= high:
                raise LaunchError(
                    f"--blacklist-cooldown-range {low:g} {high:g}: need 0 <= MIN <= MAX"
                )
            cooldown = (float(low), float(high))

        fixed_hosts: tuple[Host, ...] | None = None
        if args.hosts is not None:
            fixed_hosts = tuple(parse_hosts(args.hosts))
        elif args.hostfile is None and script is None:
            allocation = detect_allocation(env)
            if allocation is not None:
                fixed_hosts = allocation.hosts
            elif num_proc is None:
                raise LaunchError(
                    "-np/--num-proc is required (or give -H/--hosts, --hostfile or "
                    "--host-discovery-script)"
                )
            else:
                fixed_hosts = (Host("localhost", num_proc),)
        if fixed_hosts is not None and num_proc is not None:
            total = sum(host.slots for host in fixed_hosts)
            if total < num_proc:
                raise LaunchError(
                    f"-np {num_proc} needs {num_proc} slots but the hosts provide only "
                    f"{total} ({format_hosts(fixed_hosts)}); give more slots or a smaller -np"
                )

        poll_text = env.get(POLL_SECONDS_ENV, "").strip()
        try:
            poll_seconds = float(poll_text) if poll_text else 1.0
        except ValueError:
            poll_seconds = -1.0
        if not poll_seconds > 0:
            raise LaunchError(f"{POLL_SECONDS_ENV}={poll_text!r} is not a positive number")

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
