"""Where an elastic job may run next: the discovery script's hosts, and how they changed.

``--host-discovery-script`` is an executable that prints one ``host`` or ``host:slots`` per
line (a host without slots takes ``--slots-per-host``) and exits with status 0; it runs
before every launch and, while one runs, every ``BAGUAHVD_ELASTIC_POLL_SECONDS``. A change
of the host set is described to the ranks as ``added``, ``removed`` or ``mixed``
(:func:`host_change`, the ``result`` of :mod:`baguahvd.common.elastic_protocol`'s notice).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence

from baguahvd.common.elastic_protocol import HOSTS_ADDED, HOSTS_MIXED, HOSTS_REMOVED
from baguahvd.runner.elastic.settings import HostDiscoveryError
from baguahvd.runner.hosts import Host

DISCOVERY_TIMEOUT_SECONDS = 30.0
"""How long one run of ``--host-discovery-script`` may take."""
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def parse_discovered_hosts(text: str, slots_per_host: int, where: str) -> list[Host]:
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
    return [Host(name, count) for name, count in slots.items()]


def discover_hosts(script: str, slots_per_host: int) -> list[Host]:
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


def host_change(old: Sequence[Host], new: Sequence[Host]) -> str:
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
