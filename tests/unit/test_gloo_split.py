"""gloo's data plane beside another control plane: where rank 0's store is announced, and
which collectives go to the twin (the rest is run under mpirun by tests/e2e/test_parallel.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from baguahvd.backends import gloo
from baguahvd.backends.base import SelfCommunicator
from baguahvd.backends.gloo import split


class _Control:
    """Rank ``rank`` of a control plane whose broadcast returns ``answer`` (and records what
    rank 0 sent)."""

    def __init__(self, rank: int, answer: Any = None) -> None:
        self.rank = rank
        self.answer = answer
        self.sent: list[Any] = []

    def broadcast(self, payload: Any) -> Any:
        self.sent.append(payload)
        return payload if self.rank == 0 else self.answer


def test_the_address_of_an_interface_or_of_the_host_name() -> None:
    assert split.interface_address("lo") == "127.0.0.1"
    assert split.store_address("lo") == "127.0.0.1"
    assert split.store_address(None, "localhost") == "127.0.0.1"
    with pytest.raises(ValueError, match="no-such-if0.*HOROVOD_GLOO_IFACE"):
        split.interface_address("no-such-if0")


def test_a_loopback_store_across_hosts_fails_on_every_rank() -> None:
    root = _Control(0)
    with pytest.raises(ValueError, match="resolves to 127.0.0.1.*HOROVOD_GLOO_IFACE"):
        split.connect_store_over(root, "lo", 5.0, spans_hosts=True)  # type: ignore[arg-type]
    assert root.sent[0][0] == "error"
    # The other ranks raise rank 0's reason instead of waiting for a store.
    other = _Control(1, answer=root.sent[0])
    with pytest.raises(ValueError, match="resolves to 127.0.0.1"):
        split.connect_store_over(other, None, 5.0, spans_hosts=True)  # type: ignore[arg-type]


def test_an_interface_without_address_fails_on_every_rank() -> None:
    root = _Control(0)
    with pytest.raises(ValueError, match="no-such-if0"):
        split.connect_store_over(root, "no-such-if0", 5.0, spans_hosts=False)  # type: ignore[arg-type]
    assert root.sent[0][0] == "error" and "no-such-if0" in root.sent[0][1]


def test_one_host_meets_on_loopback() -> None:
    root = _Control(0)
    store = split.connect_store_over(root, "lo", 5.0, spans_hosts=False)  # type: ignore[arg-type]
    kind, address = root.sent[0]
    assert kind == "address" and address == f"127.0.0.1:{store.port}"


class _Group:
    """The bits of a ProcessGroupGloo that a GlooCommunicator reads at construction."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


class _Twin(SelfCommunicator):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.freed = False

    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        self.calls.append("sendrecv")
        super().sendrecv(tensor_out, tensor_in, peer)

    def alltoall(self, tensor_in: Any, send_counts: Any, tensor_out: Any, recv_counts: Any) -> None:
        self.calls.append("alltoall")
        super().alltoall(tensor_in, send_counts, tensor_out, recv_counts)

    def free(self) -> None:
        self.freed = True


def test_pairwise_exchanges_run_on_the_twin() -> None:
    twin = _Twin()
    comm = gloo.TwinnedCommunicator(_Group(), twin)
    out = torch.zeros(3)
    comm.sendrecv(torch.ones(3), out, 0)
    comm.alltoall(torch.full((3,), 2.0), [3], out, [3])
    assert twin.calls == ["sendrecv", "alltoall"] and out.tolist() == [2.0, 2.0, 2.0]
    assert gloo.twin_of(comm) is twin
    alone = SelfCommunicator()
    assert gloo.twin_of(alone) is alone
    comm.free()
    assert twin.freed
