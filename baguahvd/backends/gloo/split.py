"""gloo's data plane beside another control plane: an MPI job whose CPU collectives run on
gloo.

The job is launched and met through MPI (mpirun); its negotiation, alarms, exit barrier and
abort stay on MPI's control plane. Only the data communicators of process sets (the
allreduce of the gradients) become gloo process groups. They are made on a TCP store that
rank 0 hosts: rank 0 opens it on a free port and sends its address to the other ranks over
the control plane's broadcast, so gloo needs no launcher variables of its own.

Each process set also gets a communicator of the control plane's transport for the same
ranks, made at the same time: device (GPU) communicators are built from it (NCCL's unique
id travels over MPI), so CUDA tensors are unaffected, and the pairwise exchanges
(``sendrecv``, ``alltoall``) run on it (see :class:`TwinnedCommunicator`).

Why: over TCP between hosts gloo's allreduce runs at the link rate while Open MPI's
blocking collectives busy-poll the cores that backward needs (measured in
``benchmarks/algorithms.py``; see :mod:`baguahvd.runtime.transport`).
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from baguahvd.backends.base import Communicator, ControlPlane, Pending
from baguahvd.backends.gloo.communicator import GlooCommunicator
from baguahvd.backends.gloo.setup import GlooWorld

_SIOCGIFADDR = 0x8915


def interface_address(interface: str) -> str:
    """The IPv4 address of the network interface ``interface`` (Linux).

    Raises:
        ValueError: the interface does not exist or has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(
                probe.fileno(), _SIOCGIFADDR, struct.pack("256s", interface[:15].encode())
            )
        except OSError as error:
            raise ValueError(
                f"network interface {interface!r} (HOROVOD_GLOO_IFACE) has no IPv4 address: "
                f"{error}"
            ) from None
    return socket.inet_ntoa(answer[20:24])


def store_address(interface: str | None, hostname: str | None = None) -> str:
    """Where the other ranks can reach rank 0's store: the address of ``interface`` when one
    is given, else what this host's name resolves to (gloo's own default, too)."""
    if interface is not None:
        return interface_address(interface)
    name = hostname if hostname is not None else socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def connect_store_over(
    control: ControlPlane, interface: str | None, timeout_s: float, spans_hosts: bool
) -> Any:
    """A TCP store of the job, hosted by rank 0, its address sent over ``control``.

    Collective over every rank of ``control``.

    Raises:
        ValueError: rank 0 has no address for the others: ``interface`` has none, or the
            job spans hosts and this host's name resolves to a loopback address. Every rank
            raises (rank 0 broadcasts the reason), so all can fall back alike.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if control.rank == 0:
        try:
            host = store_address(interface)
            if spans_hosts and _is_loopback(host):
                raise ValueError(
                    f"this host's name resolves to {host}, which the other hosts cannot "
                    "reach, so gloo's data plane has no address to meet at; set "
                    "HOROVOD_GLOO_IFACE to the network interface between the hosts, or "
                    "BAGUAHVD_CPU_BACKEND=mpi"
                )
        except ValueError as error:
            control.broadcast(("error", str(error)))
            raise
        store = dist.TCPStore("0.0.0.0", 0, None, True, timeout, wait_for_workers=False)
        control.broadcast(("address", f"{host}:{store.port}"))
        return store
    kind, text = control.broadcast(None)
    if kind == "error":
        raise ValueError(text)
    host, _, port = str(text).rpartition(":")
    return dist.TCPStore(host, int(port), None, False, timeout, wait_for_workers=False)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class TwinnedCommunicator(GlooCommunicator):
    """A gloo communicator that also holds ``twin``, the control plane's communicator of
    the same ranks (device communicators are made from it); freeing one frees both.

    Exchanges in which both ranks of a pair send at once (``sendrecv``: Adasum;
    ``alltoall``: bytegrad) run on the twin: over TCP gloo's ran at half the link rate
    (33.6 MB sendrecv at 100 Mbit/s: 5.60 s against MPI's 2.85 s; 8.4 MB alltoall 0.65 s
    against 0.35 s), where its allreduce beat MPI's (2.83 s against 3.10 s, with a seventh
    of the CPU; ``benchmarks/results/data_plane/collectives.txt``).
    """

    def __init__(self, group: Any, twin: Communicator) -> None:
        super().__init__(group)
        self.twin = twin

    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        self.twin.sendrecv(tensor_out, tensor_in, peer)

    def alltoall(
        self,
        tensor_in: torch.Tensor,
        send_counts: Sequence[int],
        tensor_out: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> None:
        self.twin.alltoall(tensor_in, send_counts, tensor_out, recv_counts)

    def free(self) -> None:
        self.twin.free()
        super().free()


def twin_of(comm: Communicator) -> Communicator:
    """The control plane's communicator of ``comm``'s ranks: its twin where it has one,
    else ``comm`` itself (a group of one)."""
    return comm.twin if isinstance(comm, TwinnedCommunicator) else comm


class SplitControlPlane(ControlPlane):
    """``control`` for negotiation, alarms and exit; gloo process groups of ``world`` as
    the data communicators of process sets (see the module docstring)."""

    def __init__(self, control: ControlPlane, world: GlooWorld) -> None:
        self.control = control
        self.world = world
        self.rank = control.rank
        self.size = control.size
        self.threads_multiple = control.threads_multiple
        self.abort_name = control.abort_name

    def create_group_comm(self, ranks: Sequence[int]) -> Communicator | None:
        """A gloo communicator of ``ranks`` with its twin on the control plane's transport
        (:class:`TwinnedCommunicator`); ``None`` on non-members."""
        twin = self.control.create_group_comm(ranks)
        if twin is None:
            return None
        return TwinnedCommunicator(self.world.group(sorted(ranks), "data"), twin)

    def start_bitwise_and(self, words: np.ndarray) -> Pending:
        return self.control.start_bitwise_and(words)

    def gather(self, payload: Any) -> list[Any] | None:
        return self.control.gather(payload)

    def broadcast(self, payload: Any) -> Any:
        return self.control.broadcast(payload)

    def send(self, payload: Any, peer: int) -> None:
        self.control.send(payload, peer)

    def recv(self, peer: int) -> Any:
        return self.control.recv(peer)

    def allgather_ints(self, values: Sequence[int]) -> list[list[int]]:
        return self.control.allgather_ints(values)

    def exit_barrier(self, timeout_s: float, ranks: Sequence[int]) -> bool:
        return self.control.exit_barrier(timeout_s, ranks)

    def raise_alarm(self, payload: Any, ranks: Sequence[int]) -> None:
        self.control.raise_alarm(payload, ranks)

    def poll_alarm(self) -> tuple[int, Any] | None:
        return self.control.poll_alarm()

    def acknowledge(self, rank: int) -> None:
        self.control.acknowledge(rank)

    def acknowledged(self) -> set[int]:
        return self.control.acknowledged()

    def abort(self, code: int) -> None:
        self.control.abort(code)

    def end_process(self, status: int) -> None:
        self.control.end_process(status)

    def free(self) -> None:
        self.control.free()
