"""The gloo data plane: collectives on CPU tensors over a torch ``ProcessGroupGloo``.

The process groups are built directly on a store (see :mod:`~baguahvd.backends.gloo.setup`),
never through ``torch.distributed.init_process_group``: baguahvd leaves torch's default group
to the user, and a group of some ranks can then be made by its members alone.

Reductions of float16/bfloat16 are carried out in float32 and rounded once at the end, as
the MPI data plane does, so both transports give the same numbers. Byte-moving collectives
(allgather, broadcast, alltoall, sendrecv) send the raw bytes, so they work for every dtype.
Gloo's allgather wants blocks of one size, so blocks are padded to the largest; its
reduce-scatter wants equal blocks too, so unequal ones are reduced in full and sliced.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from baguahvd.backends.base import Communicator, Started, byte_counts
from baguahvd.common.ops import ReduceOp

_GLOO_OPS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

_REDUCIBLE = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float32, torch.float64,
)

# Reduced in float32, as the MPI data plane does.
_WIDENED = (torch.float16, torch.bfloat16)


def reduce_options(op: ReduceOp | Any) -> Any:
    """gloo's options of an allreduce with ``op`` (a :class:`ReduceOp` or a torch one)."""
    options = dist.AllreduceOptions()
    if isinstance(op, ReduceOp):
        try:
            options.reduceOp = _GLOO_OPS[op]
        except KeyError:
            raise ValueError(f"The gloo backend cannot reduce with {op.name} directly.") from None
    else:
        options.reduceOp = op
    return options


def _check_reducible(tensor: torch.Tensor) -> None:
    if tensor.dtype not in _REDUCIBLE and tensor.dtype not in _WIDENED:
        raise TypeError(f"The gloo backend cannot reduce tensors of type {tensor.dtype}.")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor's storage as a flat uint8 tensor (a view, no copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of ``tensor``; it must be contiguous, so that writes reach it."""
    if not tensor.is_contiguous():
        raise ValueError("The gloo backend needs contiguous tensors.")
    return tensor.detach().view(-1)


def wait(work: Any, failed: threading.Event | None = None) -> None:
    """Waits for gloo ``work``; gloo's wait releases the GIL while it blocks. A failure
    (a peer's connection closed, a timeout) is raised after setting ``failed``."""
    try:
        work.wait()
    except RuntimeError:
        if failed is not None:
            failed.set()
        raise


class StoreIdChannel:
    """Carries the NCCL unique id of a device communicator from the set's first rank to its
    members through the job's store, for
    :func:`baguahvd.backends.nccl_setup.exchange_unique_id`: the first rank sets the key,
    the others poll it (``check`` does not block), so the wait stays under the creation's
    deadline."""

    def __init__(self, store: Any, rank: int, size: int, key: str) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.key = key

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def start_unique_id(self, unique_id: bytes | None) -> Callable[[], bytes | None]:
        """Publishes ``unique_id`` (the first rank) or starts waiting for it (the others);
        returns a poll that answers the id once it is here, else None."""
        if unique_id is not None:
            self.store.set(self.key, unique_id)
            return lambda: unique_id

        def poll() -> bytes | None:
            if not self.store.check([self.key]):
                return None
            return bytes(self.store.get(self.key))

        return poll


class GlooCommunicator(Communicator):
    """A :class:`Communicator` over a ``ProcessGroupGloo`` (CPU tensors)."""

    unfused_bytes = 8 << 20
    """A call costs about a millisecond even on one machine, so only large tensors gain
    from a call of their own: at 8 MiB a tensor alone beats the copies through the fusion
    buffer, at 2 MiB fusing still wins (``benchmarks/results/shared_memory/NOTES.md``)."""

    launches_allreduce = True
    """The group's worker threads run its collectives: :meth:`start_allreduce` returns at
    once, and the reductions started go out on the wire back to back, in the order started."""

    def __init__(
        self, group: Any, store: Any = None, failed: threading.Event | None = None
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.store = store
        """The store of this group's members (None where the group was made without one)."""
        self.failed = failed
        """Set when a collective of this communicator fails (shared by a job's groups:
        :attr:`GlooWorld.failed <baguahvd.backends.gloo.setup.GlooWorld.failed>`)."""
        self._unique_ids = 0

    def id_channel(self) -> StoreIdChannel:
        """A channel for the NCCL unique id of the next device communicator made from this
        one: the members make theirs in the same order, so they meet under the same key."""
        if self.store is None:
            raise ValueError("this gloo communicator was made without a store")
        self._unique_ids += 1
        return StoreIdChannel(
            self.store, self.rank, self.size, f"nccl-unique-id/{self._unique_ids}"
        )

    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        work, wide = self._start_allreduce(tensor_in, tensor_out, op)
        wait(work, self.failed)
        if wide is not None:
            _flat(tensor_out).copy_(wide)

    def _start_allreduce(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp
    ) -> tuple[Any, torch.Tensor | None]:
        """Starts the reduction; returns the work and, for float16/bfloat16, the float32
        buffer that holds the result until it is copied into ``tensor_out``."""
        _check_reducible(tensor_out)
        options = reduce_options(op)
        if tensor_out.dtype in _WIDENED:
            wide = tensor_in.detach().float().reshape(-1)
            return self.group.allreduce([wide], options), wide
        out = _flat(tensor_out)
        if tensor_in.data_ptr() != tensor_out.data_ptr():
            out.copy_(tensor_in.detach().reshape(-1))
        return self.group.allreduce([out], options), None

    def allgather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, counts: Sequence[int]
    ) -> None:
        item = tensor_out.element_size()
        block = max(counts) * item
        mine = torch.zeros(block, dtype=torch.uint8)
        mine[: counts[self.rank] * item].copy_(
            _bytes(tensor_in.contiguous())[: counts[self.rank] * item]
        )
        blocks = [torch.empty(block, dtype=torch.uint8) for _ in range(self.size)]
        wait(self.group.allgather([blocks], [mine]), self.failed)
        out = _bytes(tensor_out)
        offset = 0
        for count, received in zip(counts, blocks):
            length = count * item
            out[offset : offset + length].copy_(received[:length])
            offset += length

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        wait(self.group.broadcast([_bytes(_contiguous(tensor))], options), self.failed)

    def alltoall(
        self,
        tensor_in: torch.Tensor,
        send_counts: Sequence[int],
        tensor_out: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> None:
        send = byte_counts(tensor_in, send_counts)
        recv = byte_counts(tensor_in, recv_counts)
        source = _bytes(tensor_in.contiguous())[: sum(send)]
        target = _bytes(_contiguous(tensor_out))[: sum(recv)]
        work = self.group.alltoall_base(target, source, recv, send, dist.AllToAllOptions())
        wait(work, self.failed)

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor,
        counts: Sequence[int],
        op: ReduceOp,
    ) -> None:
        total = sum(counts)
        reduced = torch.empty(total, dtype=tensor_in.dtype)
        self.allreduce(tensor_in.detach().reshape(-1)[:total], reduced, op)
        start = sum(counts[: self.rank])
        tensor_out.view(-1)[: counts[self.rank]].copy_(reduced[start : start + counts[self.rank]])

    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        sent = self.group.send([_bytes(tensor_out.contiguous())], peer, 0)
        received = self.group.recv([_bytes(_contiguous(tensor_in))], peer, 0)
        wait(sent, self.failed)
        wait(received, self.failed)

    def barrier(self) -> None:
        wait(self.group.barrier(), self.failed)

    def iallreduce(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp
    ) -> PendingWork:
        """Starts :meth:`allreduce` without waiting; ``tensor_out`` holds the result once
        the returned request's ``test()`` is True. Both tensors must stay untouched until
        then."""
        work, wide = self._start_allreduce(tensor_in, tensor_out, op)
        if wide is None:
            return PendingWork(work, (tensor_in, tensor_out), failed=self.failed)
        return PendingWork(
            work, (wide,), lambda: _flat(tensor_out).copy_(wide), failed=self.failed
        )

    def start_allreduce(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp
    ) -> PendingWork:
        return self.iallreduce(tensor_in, tensor_out, op)

    def ibarrier(self) -> PendingWork:
        """Starts :meth:`barrier` without waiting."""
        return PendingWork(self.group.barrier(), (), failed=self.failed)

    def free(self) -> None:
        self.group = None


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("The gloo backend needs contiguous output tensors.")
    return tensor


class PendingWork(Started):
    """A started gloo collective, polled with :meth:`test` (the MPI backend's
    ``PendingRequest`` contract) or waited for with :meth:`wait`."""

    def __init__(
        self,
        work: Any,
        keep_alive: tuple[torch.Tensor, ...],
        finish: Callable[[], object] | None = None,
        failed: threading.Event | None = None,
    ) -> None:
        self._work = work
        self._keep_alive = keep_alive
        self._finish = finish
        self._failed = failed
        self._done = False
        self._future: Any = None

    def notify(self, callback: Callable[[], object]) -> bool:
        """Calls ``callback()`` when gloo's future for the collective completes (in gloo's
        thread, or here if it has)."""
        try:
            future = self._work.get_future()
        except RuntimeError:  # a work without a future: polled instead
            return False
        self._future = future
        future.add_done_callback(lambda _: callback())
        return True

    def test(self) -> bool:
        """Whether the collective has completed (its output is then in place). Its future
        completes, and runs the callbacks of :meth:`notify`, just before its work says it
        is completed: either counts (the wait for the work is then over at once)."""
        if not self._done and (
            self._work.is_completed() or (self._future is not None and self._future.done())
        ):
            self.wait()
        return self._done

    def wait(self) -> None:
        """Returns once the collective has completed (gloo's wait releases the GIL)."""
        if self._done:
            return
        wait(self._work, self._failed)  # raises the collective's error, if any
        self._done = True
        if self._finish is not None:
            self._finish()
        self._keep_alive = ()

