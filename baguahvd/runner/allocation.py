"""The hosts a batch system or an MPI operator gave this job, read from the environment.

When ``baguahvdrun`` gets neither ``-H`` nor ``--hostfile``, :func:`detect_allocation` looks
for an allocation in this order and the first one found gives the hosts and their slots:

1. an Open MPI default host file (``OMPI_MCA_orte_default_hostfile``,
   ``OMPI_MCA_prte_default_hostfile`` or ``PRTE_MCA_prte_default_hostfile``; Kubeflow's
   MPIJob sets one of them), read like ``--hostfile``;
2. Slurm: ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``), a compressed list such as
   ``node[01-03,07],login1``, with the slots from ``SLURM_TASKS_PER_NODE`` or, without it,
   ``SLURM_JOB_CPUS_PER_NODE`` (``2(x3),1``: two slots on each of three nodes, then one);
3. PBS/Torque: ``PBS_NODEFILE``, one line per slot;
4. LSF: ``LSB_MCPU_HOSTS`` (``hostA 4 hostB 4``) or ``LSB_DJOB_HOSTFILE`` (one line per slot).

Every parser here is a pure function of its text; a malformed value raises
:class:`~baguahvd.runner.hosts.LaunchError` naming the variable it came from.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from baguahvd.runner.hosts import Host, LaunchError, parse_hostfile

MPI_HOSTFILE_VARIABLES = (
    "OMPI_MCA_orte_default_hostfile",
    "OMPI_MCA_prte_default_hostfile",
    "PRTE_MCA_prte_default_hostfile",
)
"""Open MPI's default host file settings, in the order they are consulted."""

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class Allocation:
    """Hosts given to the job by its environment."""

    source: str
    """Where they came from, for messages (e.g. ``Slurm (SLURM_JOB_NODELIST)``)."""
    hosts: tuple[Host, ...]
    """The hosts in the allocation's order, each with its slots."""


def expand_slurm_nodelist(text: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expands a Slurm compressed host list.

    ``node[01-03,07],gpu-a[1-2]-b[1-2],login1`` gives ``node01, node02, node03, node07,
    gpu-a1-b1, gpu-a1-b2, gpu-a2-b1, gpu-a2-b2, login1``: a range keeps the zero padding of
    its lower bound, and several bracket groups in one name multiply.

    Args:
        text: the variable's value.
        variable: its name, for error messages.

    Returns:
        The host names in order.

    Raises:
        LaunchError: unbalanced brackets, an empty name, or a malformed range.
    """
    names: list[str] = []
    for item in _split_top_level(text, variable):
        names.extend(_expand_name(item, text, variable))
    if not names:
        raise LaunchError(f"{variable}={text!r} lists no hosts")
    return names


def _split_top_level(text: str, variable: str) -> list[str]:
    items: list[str] = []
    depth = 0
    current = ""
    for char in text.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"{variable}={text!r}: ']' without '['")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise LaunchError(f"{variable}={text!r}: '[' without ']'")
    items.append(current)
    for item in items:
        if not item.strip():
            raise LaunchError(f"{variable}={text!r} has an empty host name")
    return [item.strip() for item in items]


def _expand_name(item: str, text: str, variable: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, body, rest = item[:start], item[start + 1 : end], item[end + 1 :]
    tails = _expand_name(rest, text, variable) if rest else [""]
    expanded: list[str] = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise LaunchError(
                f"{variable}={text!r}: {part!r} in [{body}] is not a number or a range a-b"
            )
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise LaunchError(f"{variable}={text!r}: range {part!r} runs backwards")
        width = len(low_text)
        for number in range(low, high + 1):
            expanded.extend(f"{prefix}{number:0{width}d}{tail}" for tail in tails)
    return expanded


def expand_slurm_counts(text: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expands a Slurm per-node count list: ``2(x3),1`` gives ``[2, 2, 2, 1]``.

    Args:
        text: the variable's value.
        variable: its name, for error messages.

    Returns:
        One count per node.

    Raises:
        LaunchError: an entry is not ``N`` or ``N(xM)``, or a count is below 1.
    """
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _COUNT.fullmatch(item.strip())
        if match is None:
            raise LaunchError(f"{variable}={text!r}: {item!r} is not N or N(xM)")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if count < 1 or repeat < 1:
            raise LaunchError(f"{variable}={text!r}: {item!r} must count at least 1")
        counts.extend([count] * repeat)
    return counts


def slurm_hosts(env: Mapping[str, str]) -> Allocation | None:
    """The hosts of a Slurm job, or ``None`` outside one.

    Args:
        env: the launcher's environment.

    Returns:
        The allocation; ``None`` when no node list variable is set.

    Raises:
        LaunchError: a malformed node list or count list, no count list, or a count list
            that does not match the node list.
    """
    list_variable = next(
        (name for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(name)), None
    )
    if list_variable is None:
        return None
    names = expand_slurm_nodelist(env[list_variable], list_variable)
    count_variable = next(
        (
            name
            for name in ("SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE")
            if env.get(name)
        ),
        None,
    )
    if count_variable is None:
        raise LaunchError(
            f"{list_variable} is set but neither SLURM_TASKS_PER_NODE nor "
            "SLURM_JOB_CPUS_PER_NODE is; give -H/--hosts explicitly"
        )
    counts = expand_slurm_counts(env[count_variable], count_variable)
    if len(counts) != len(names):
        raise LaunchError(
            f"{count_variable}={env[count_variable]!r} counts {len(counts)} nodes but "
            f"{list_variable}={env[list_variable]!r} lists {len(names)}"
        )
    return Allocation(
        f"Slurm ({list_variable}, {count_variable})", _merge_named(zip(names, counts))
    )


def count_host_lines(text: str, variable: str) -> tuple[Host, ...]:
    """Reads a node file with one line per slot (PBS, ``LSB_DJOB_HOSTFILE``).

    Args:
        text: the file's content.
        variable: the variable that named the file, for error messages.

    Returns:
        The hosts in order of first appearance, each with as many slots as lines.

    Raises:
        LaunchError: the file lists no host.
    """
    names = [line.split()[0] for line in text.splitlines() if line.split()]
    if not names:
        raise LaunchError(f"the file named by {variable} lists no hosts")
    return _merge_named((name, 1) for name in names)


def parse_lsf_mcpu_hosts(text: str, variable: str = "LSB_MCPU_HOSTS") -> tuple[Host, ...]:
    """Parses LSF's ``hostA 4 hostB 4``: host names, each followed by its slots.

    Args:
        text: the variable's value.
        variable: its name, for error messages.

    Returns:
        The hosts in order.

    Raises:
        LaunchError: an odd number of words, or a slot count that is not a positive integer.
    """
    words = text.split()
    if not words or len(words) % 2:
        raise LaunchError(f"{variable}={text!r}: expected 'host slots host slots ...'")
    pairs: list[tuple[str, int]] = []
    for name, slots in zip(words[::2], words[1::2]):
        if not slots.isdigit() or int(slots) < 1:
            raise LaunchError(f"{variable}={text!r}: slots {slots!r} of {name} is not positive")
        pairs.append((name, int(slots)))
    return _merge_named(pairs)


def _merge_named(pairs: Iterable[tuple[str, int]]) -> tuple[Host, ...]:
    slots: dict[str, int] = {}
    for name, count in pairs:
        slots[name] = slots.get(name, 0) + count
    return tuple(Host(name, count) for name, count in slots.items())


def _read(path: str, variable: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise LaunchError(f"cannot read {variable}={path!r}: {error.strerror}") from None


def mpi_hostfile_hosts(env: Mapping[str, str]) -> Allocation | None:
    """The hosts of an Open MPI default host file (Kubeflow MPIJob), or ``None``."""
    for variable in MPI_HOSTFILE_VARIABLES:
        path = env.get(variable)
        if path:
            try:
                hosts = parse_hostfile(path)
            except LaunchError as error:
                raise LaunchError(f"{variable}: {error}") from None
            return Allocation(f"Open MPI default hostfile ({variable})", tuple(hosts))
    return None


def pbs_hosts(env: Mapping[str, str]) -> Allocation | None:
    """The hosts of a PBS/Torque job (``PBS_NODEFILE``), or ``None`` outside one."""
    path = env.get("PBS_NODEFILE")
    if not path:
        return None
    text = _read(path, "PBS_NODEFILE")
    return Allocation("PBS (PBS_NODEFILE)", count_host_lines(text, "PBS_NODEFILE"))


def lsf_hosts(env: Mapping[str, str]) -> Allocation | None:
    """The hosts of an LSF job (``LSB_MCPU_HOSTS``, else ``LSB_DJOB_HOSTFILE``), or ``None``."""
    if env.get("LSB_MCPU_HOSTS"):
        return Allocation("LSF (LSB_MCPU_HOSTS)", parse_lsf_mcpu_hosts(env["LSB_MCPU_HOSTS"]))
    path = env.get("LSB_DJOB_HOSTFILE")
    if not path:
        return None
    text = _read(path, "LSB_DJOB_HOSTFILE")
    return Allocation("LSF (LSB_DJOB_HOSTFILE)", count_host_lines(text, "LSB_DJOB_HOSTFILE"))


_DETECTORS: tuple[Callable[[Mapping[str, str]], Allocation | None], ...] = (
    mpi_hostfile_hosts,
    slurm_hosts,
    pbs_hosts,
    lsf_hosts,
)


def detect_allocation(env: Mapping[str, str]) -> Allocation | None:
    """The first allocation found in ``env``, in the order of the module docstring.

    Args:
        env: the launcher's environment.

    Returns:
        The allocation, or ``None`` when the job runs outside any.

    Raises:
        LaunchError: the variables of the allocation found are malformed; the message
            names the variable.
    """
    for detector in _DETECTORS:
        allocation = detector(env)
        if allocation is not None:
            return allocation
    return None
