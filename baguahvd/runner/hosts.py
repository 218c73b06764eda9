"""Where ``baguahvdrun`` runs: hosts, their slots, and which of them are this machine.

``-H``/``--hosts`` takes ``host[:slots][,host[:slots]...]``; ``--hostfile`` takes one
``hostname [slots=N]`` per line (``max_slots=N`` is accepted and ignored, ``#`` starts a
comment). In both, a repeated name adds its slots to the first entry of that name, and a
host without slots takes one. Everything here is pure apart from reading the host file and
this machine's name.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass

_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class LaunchError(ValueError):
    """The command line cannot be launched; ``main`` reports it like an argparse error."""


@dataclass(frozen=True)
class Host:
    """One entry of ``-H``/``--hostfile``: a host name and how many ranks it takes."""

    name: str
    slots: int


def parse_hosts(text: str) -> list[Host]:
    """Parses ``-H``'s ``host[:slots][,host[:slots]...]``; a host without slots takes one.

    Args:
        text: the flag's value, e.g. ``"node1:4,node2:4"``.

    Returns:
        The hosts in order, with repeated names merged (their slots added up).

    Raises:
        LaunchError: an empty host name or a slot count that is not a positive integer.
    """
    hosts: list[Host] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise LaunchError(f"-H/--hosts {text!r} has an empty entry; use host:slots,...")
        name, sep, slots_text = item.rpartition(":")
        if not sep:
            name, slots_text = item, "1"
        hosts.append(Host(name.strip(), _parse_slots(slots_text, f"-H/--hosts entry {item!r}")))
    return _merge(hosts, "-H/--hosts")


def parse_hostfile(path: str) -> list[Host]:
    """Reads a host file: one ``hostname [slots=N]`` per line; ``#`` starts a comment.

    Args:
        path: the file name.

    Returns:
        The hosts in order, with repeated names merged.

    Raises:
        LaunchError: the file cannot be read, or a line is malformed.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as error:
        raise LaunchError(f"cannot read --hostfile {path!r}: {error.strerror}") from None
    hosts: list[Host] = []
    for number, line in enumerate(lines, start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path!r} line {number} ({line.strip()!r})"
        slots = 1
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep:
                raise LaunchError(f"{where}: expected 'hostname slots=N'")
            if key == "slots":
                slots = _parse_slots(value, where)
            elif key != "max_slots":
                raise LaunchError(f"{where}: unknown key {key!r}; expected 'hostname slots=N'")
        hosts.append(Host(words[0], slots))
    if not hosts:
        raise LaunchError(f"--hostfile {path!r} lists no hosts")
    return _merge(hosts, f"--hostfile {path!r}")


def _parse_slots(text: str, where: str) -> int:
    try:
        slots = int(text.strip())
    except ValueError:
        raise LaunchError(f"{where}: slots {text!r} is not an integer") from None
    if slots < 1:
        raise LaunchError(f"{where}: slots must be at least 1, got {slots}")
    return slots


def _merge(hosts: list[Host], where: str) -> list[Host]:
    slots: dict[str, int] = {}
    for host in hosts:
        if not host.name:
            raise LaunchError(f"{where}: empty host name")
        slots[host.name] = slots.get(host.name, 0) + host.slots
    return [Host(name, count) for name, count in slots.items()]


def is_local(name: str) -> bool:
    """Whether ``name`` means this machine (``localhost``, a loopback address, or its name)."""
    if name in _LOCAL_NAMES:
        return True
    hostname = socket.gethostname()
    return name in (hostname, hostname.split(".", 1)[0])


def same_host(first: str, second: str) -> bool:
    """Whether two names mean the same machine: equal, equal before the first dot, or both
    this machine (Open MPI reports ``localhost`` under the machine's own name)."""
    if first == second or first.split(".", 1)[0] == second.split(".", 1)[0]:
        return True
    return is_local(first) and is_local(second)


def format_hosts(hosts: Iterable[Host]) -> str:
    """Writes hosts as ``-H`` takes them (``a:2,b:1``), or ``no hosts``."""
    return ",".join(f"{host.name}:{host.slots}" for host in hosts) or "no hosts"
