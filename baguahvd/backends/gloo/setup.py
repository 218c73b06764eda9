"""The gloo job: its store, and process groups built on it by their members alone.

Every rank reaches one key-value store (a torch ``Store``):

- torchrun (and ``baguahvdrun --gloo``): the TCP store at MASTER_ADDR:MASTER_PORT, hosted by
  torchrun's agent (TORCHELASTIC_USE_AGENT_STORE) or else by rank 0;
- horovodrun --gloo: rank 0 starts a TCP store on a free port and publishes its address
  through horovodrun's HTTP rendezvous server (see
  :mod:`~baguahvd.backends.gloo.rendezvous`); the other ranks read it there.

A process group of some ranks is a ``ProcessGroupGloo`` over a ``PrefixStore`` whose prefix
names the group's purpose, its ranks and how many such groups this rank made before: the
members make their groups in the same order (the engine agrees on it), so they meet under
the same prefix, and non-members take no part. Everything lives under the job's namespace,
``baguahvd/<restart>/<generation>``, so a second ``hvd.init()`` after ``shutdown()``, or a
torchrun restart on the agent's store, never meets keys of an earlier one.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from baguahvd.backends.gloo.communicator import GlooCommunicator
from baguahvd.backends.gloo.rendezvous import HTTPRendezvous, reachable_address
from baguahvd.common.config import Launch

logger = logging.getLogger("baguahvd")

# The key under which rank 0 publishes its TCP store in horovodrun's rendezvous server.
_RENDEZVOUS_SCOPE = "baguahvd"
_RENDEZVOUS_KEY = "tcp_store"


class GlooWorld:
    """The store of a gloo job and the factory of its process groups.

    Args:
        store: the job's store, shared by every rank.
        rank: this process's rank in the job.
        size: number of ranks.
        group_timeout_s: how long a gloo collective may wait for its peers before failing.
        interface: the network interface of gloo's connections (``None``: torch's choice).
        restart: distinguishes launches that share one store (torchrun's restarts).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        group_timeout_s: float,
        interface: str | None = None,
        restart: int = 0,
    ) -> None:
        self.rank = rank
        self.size = size
        self.interface = interface
        self._timeout = datetime.timedelta(seconds=group_timeout_s)
        # Each rank counts its own init() calls; every rank makes the same number.
        generation = store.add(f"baguahvd/{restart}/init/{rank}", 1)
        self.namespace = f"baguahvd/{restart}/{generation}"
        self.store = dist.PrefixStore(self.namespace + "/", store)
        self._made: dict[tuple[str, tuple[int, ...]], int] = {}
        self.failed = threading.Event()
        """Set once a collective of any group of this world failed on this rank."""

    def group(self, ranks: Sequence[int], purpose: str) -> Any:
        """A ``ProcessGroupGloo`` of ``ranks`` (sorted job ranks, this rank among them),
        made by its members only, in the same order on each."""
        return self._group(ranks, purpose)[0]

    def _group(self, ranks: Sequence[int], purpose: str) -> tuple[Any, Any]:
        """:meth:`group` and the store of the group's own prefix."""
        members = tuple(ranks)
        assert self.rank in members, "only members make a group"
        count = self._made.get((purpose, members), 0)
        self._made[(purpose, members)] = count + 1
        prefix = f"{purpose}/{'-'.join(map(str, members))}/{count}/"
        store = dist.PrefixStore(prefix, self.store)
        index = members.index(self.rank)
        if self.interface is None:
            return dist.ProcessGroupGloo(store, index, len(members), self._timeout), store
        options: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = self._timeout
        options._devices = [dist.ProcessGroupGloo.create_device(interface=self.interface)]
        return dist.ProcessGroupGloo(store, index, len(members), options), store

    def new_communicator(
        self, ranks: Sequence[int] | None = None, purpose: str = "private"
    ) -> GlooCommunicator | None:
        """A data communicator of ``ranks`` (default: every rank) that nothing else uses;
        ``None`` on the ranks outside it, which need not call. Its store carries the NCCL
        unique ids of the device communicators made from it."""
        members = sorted(range(self.size) if ranks is None else ranks)
        if self.rank not in members:
            return None
        group, store = self._group(members, purpose)
        return GlooCommunicator(group, store, self.failed)


def connect_store(launch: Launch, timeout_s: float) -> Any:
    """Reaches the job's store (see the module docstring). Once per process: a store that
    rank 0 hosts lives as long as the returned object, and a later ``hvd.init()`` reuses
    it (its :class:`GlooWorld` gets a namespace of its own).

    Raises:
        ValueError: the launcher's variables do not say where the store is.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if launch.launcher == "horovodrun-gloo":
        return _store_from_rendezvous(launch, timeout)
    if launch.store_host is not None and launch.store_port is not None:
        return dist.TCPStore(
            launch.store_host,
            launch.store_port,
            None,
            launch.rank == 0 and not launch.store_hosted_by_agent,
            timeout,
            wait_for_workers=False,
        )
    if launch.size == 1:
        return dist.HashStore()
    raise ValueError(
        f"the launcher says this job has {launch.size} ranks but not where they meet: set "
        "MASTER_ADDR and MASTER_PORT (torchrun sets both), or start the job with "
        "horovodrun --gloo, torchrun or baguahvdrun --gloo"
    )


def _store_from_rendezvous(launch: Launch, timeout: datetime.timedelta) -> Any:
    if launch.rendezvous_host is None or launch.rendezvous_port is None:
        raise ValueError(
            f"HOROVOD_RANK/HOROVOD_SIZE say this job has {launch.size} ranks, but "
            "HOROVOD_GLOO_RENDEZVOUS_ADDR and HOROVOD_GLOO_RENDEZVOUS_PORT, where horovodrun "
            "--gloo's rendezvous server listens, are not set"
        )
    rendezvous = HTTPRendezvous(launch.rendezvous_host, launch.rendezvous_port)
    if launch.rank == 0:
        store = dist.TCPStore(
            "0.0.0.0", 0, None, True, timeout, wait_for_workers=False
        )
        host = reachable_address(launch.rendezvous_host, launch.rendezvous_port)
        rendezvous.put(_RENDEZVOUS_SCOPE, _RENDEZVOUS_KEY, f"{host}:{store.port}".encode())
        return store
    address = rendezvous.wait(_RENDEZVOUS_SCOPE, _RENDEZVOUS_KEY, timeout.total_seconds())
    host, _, port = address.decode().rpartition(":")
    logger.debug("the job's store is at %s:%s", host, port)
    return dist.TCPStore(host, int(port), None, False, timeout, wait_for_workers=False)
