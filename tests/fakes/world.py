"""An in-process job: N ranks as threads over an in-memory control plane and communicators.

Every rank drives a real :class:`~baguahvd.engine.engine.Engine`; only the transport is
replaced. A collective is a meeting: the k-th call of each member on a channel (the control
plane, or one process set's communicator) meets the k-th call of the others, and each
member computes the result from everybody's contribution. A point-to-point message is a
meeting of its sender alone, numbered per pair of ranks, which the receiver takes; the
sender does not wait (a small MPI message does not either). Alarms are per-rank mailboxes.

:meth:`World.close` parks every thread still waiting in a meeting for good, as MPI would
leave a rank blocked in a collective that a failed peer never joins: the engine threads are
daemon threads, and a parked thread costs nothing.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from baguahvd.backends.base import (
    Communicator,
    ControlPlane,
    DeviceCommFactory,
    Pending,
    check_peer,
)
from baguahvd.common.config import Config
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.clock import SYSTEM_CLOCK
from baguahvd.engine.engine import Engine
from tests.fakes.clock import SteppedClock

T = TypeVar("T")

_REDUCE: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.PRODUCT: torch.mul,
}


class World:
    """The shared state of the in-process job (see module docstring)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._meetings: dict[tuple[object, ...], dict[int, Any]] = {}
        self._left: dict[tuple[object, ...], int] = {}
        self._group_counts: dict[tuple[int, tuple[int, ...]], int] = {}
        self._alarms: list[list[tuple[int, Any]]] = [[] for _ in range(size)]
        self._acks: list[set[int]] = [set() for _ in range(size)]
        self._alarm_lock = threading.Lock()
        self.aborts: list[tuple[int, int]] = []
        self.exits: list[tuple[int, int]] = []
        """(rank, status) of every rank that ended its process after the exit barrier."""
        """(rank, code) of every abort()."""
        self.closed = False
        self._never = threading.Event()
        self._holding = False
        self._held: set[int] = set()
        self.calls: dict[str, int] = {}
        """How often each control-plane operation ran (counted once per rank)."""

    def meet(
        self,
        key: tuple[object, ...],
        rank: int,
        members: int,
        value: Any,
        timeout_s: float | None = None,
    ) -> dict[int, Any] | None:
        """Leaves ``value`` at meeting ``key`` and returns everyone's values by rank once
        ``members`` ranks came; ``None`` after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.arrive(key, rank, value)
        with self._cond:
            while not self._ready(key, members):
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                self._cond.wait(0.002)
        values = self.collect(key, members)
        assert values is not None
        return values

    def arrive(self, key: tuple[object, ...], rank: int, value: Any) -> None:
        """Leaves ``value`` at meeting ``key`` without waiting (see :meth:`collect`)."""
        with self._cond:
            self._meetings.setdefault(key, {})[rank] = value
            self._cond.notify_all()

    def collect(
        self, key: tuple[object, ...], members: int, held: int | None = None
    ) -> dict[int, Any] | None:
        """Everyone's values at meeting ``key`` by rank once ``members`` ranks came, else
        None; never blocks, except in a closed world (see module docstring). ``held``: the
        rank of a bitwise AND, which does not complete while the world holds them (see
        :meth:`hold`)."""
        with self._cond:
            if held is not None and self._holding:
                self._held.add(held)
                self._cond.notify_all()
                return None
            meeting = self._meetings.get(key, {})
            if len(meeting) >= members:
                values = dict(meeting)
                left = self._left.get(key, 0) + 1
                if left == members:
                    del self._meetings[key]
                    self._left.pop(key, None)
                else:
                    self._left[key] = left
                return values
            if not self.closed:
                return None
        # Closed while waiting for a rank that never comes: block for good.
        self._never.wait()
        raise AssertionError("unreachable")

    def receive(self, key: tuple[object, ...]) -> Any:
        """Waits for the value one rank left at ``key`` (:meth:`arrive`) and takes it; in a
        closed world, blocks for good unless it is there."""
        with self._cond:
            while key not in self._meetings and not self.closed:
                self._cond.wait(0.002)
        values = self.collect(key, 1)
        assert values is not None
        (value,) = values.values()
        return value

    def pause(self, key: tuple[object, ...], members: int, timeout_s: float) -> None:
        """Waits until meeting ``key`` is complete, the world closes or ``timeout_s`` has
        passed (2 ms at least: an arrival ends the wait anyway)."""
        with self._cond:
            if self._holding or not self._ready(key, members):
                self._cond.wait(max(timeout_s, 0.002))

    def _ready(self, key: tuple[object, ...], members: int) -> bool:
        return len(self._meetings.get(key, ())) >= members or self.closed

    def hold(self) -> None:
        """Keeps every bitwise AND from completing until :meth:`release`: once every
        engine waits in one (:meth:`wait_held`), what the ranks submit meanwhile is taken
        by their next cycle, all of it at once."""
        with self._cond:
            self._holding = True
            self._held.clear()

    def wait_held(self, timeout_s: float = 10.0) -> None:
        """Returns once every rank waits in a bitwise AND that :meth:`hold` holds."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._held) < self.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._held)} of {self.size} ranks are held")
                self._cond.wait(left)

    def release(self) -> None:
        """Lets the bitwise ANDs complete again."""
        with self._cond:
            self._holding = False
            self._cond.notify_all()

    def group_key(self, rank: int, ranks: tuple[int, ...]) -> tuple[object, ...]:
        """The channel of the next communicator of ``ranks`` this rank creates."""
        with self._cond:
            count = self._group_counts.get((rank, ranks), 0)
            self._group_counts[(rank, ranks)] = count + 1
        return ("group", ranks, count)

    def count(self, operation: str) -> None:
        with self._cond:
            self.calls[operation] = self.calls.get(operation, 0) + 1

    def post_alarm(self, source: int, payload: Any, ranks: Sequence[int]) -> None:
        with self._alarm_lock:
            for rank in ranks:
                self._alarms[rank].append((source, payload))

    def take_alarm(self, rank: int) -> tuple[int, Any] | None:
        with self._alarm_lock:
            return self._alarms[rank].pop(0) if self._alarms[rank] else None

    def ack(self, source: int, rank: int) -> None:
        with self._alarm_lock:
            self._acks[rank].add(source)

    def acks_of(self, rank: int) -> set[int]:
        with self._alarm_lock:
            return set(self._acks[rank])

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class _Endpoint:
    """One rank's numbered calls on one channel."""

    def __init__(self, world: World, channel: tuple[object, ...], rank: int, members: int):
        self.world = world
        self.channel = channel
        self.rank = rank
        self.members = members
        self._calls = 0

    def next_key(self) -> tuple[object, ...]:
        key = (*self.channel, self._calls)
        self._calls += 1
        return key

    def meet(self, value: Any, timeout_s: float | None = None) -> dict[int, Any] | None:
        return self.world.meet(self.next_key(), self.rank, self.members, value, timeout_s)

    def all(self, value: Any) -> list[Any]:
        values = self.meet(value)
        assert values is not None
        return [values[r] for r in range(self.members)]


class MemoryControlPlane(ControlPlane):
    """One rank's :class:`ControlPlane` in a :class:`World`."""

    threads_multiple = True
    fail_next: BaseException | None = None
    """Raised (once) by the next bitwise AND, which never reaches the others: a failure of
    the exchange on this rank only (gloo's, when a peer's connection closes)."""

    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self._negotiation = _Endpoint(world, ("control",), rank, world.size)
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        """Messages sent to and received from each peer so far (:meth:`send`)."""

    def start_bitwise_and(self, words: np.ndarray) -> Pending:
        self.world.count("bitwise_and")
        key = self._negotiation.next_key()
        failure, self.fail_next = self.fail_next, None
        if failure is None:
            self.world.arrive(key, self.rank, words.copy())
        return _MemoryAnd(self.world, key, self.rank, words, failure)

    def gather(self, payload: Any) -> list[Any] | None:
        self.world.count("gather")
        values = self._negotiation.all(payload)
        return values if self.rank == 0 else None

    def broadcast(self, payload: Any) -> Any:
        return self._negotiation.all(payload)[0]

    def send(self, payload: Any, peer: int) -> None:
        check_peer(self, peer)
        self.world.count("send")
        count = self._sent.get(peer, 0)
        self._sent[peer] = count + 1
        self.world.arrive(("message", self.rank, peer, count), self.rank, payload)

    def recv(self, peer: int) -> Any:
        check_peer(self, peer)
        count = self._received.get(peer, 0)
        self._received[peer] = count + 1
        return self.world.receive(("message", peer, self.rank, count))

    def allgather_ints(self, values: Sequence[int]) -> list[list[int]]:
        return [list(v) for v in self._negotiation.all(list(values))]

    def create_group_comm(self, ranks: Sequence[int]) -> Communicator | None:
        ranks = tuple(sorted(ranks))
        if self.rank not in ranks:
            return None
        return MemoryCommunicator(self.world, self.world.group_key(self.rank, ranks), ranks,
                                  self.rank)

    def exit_barrier(self, timeout_s: float, ranks: Sequence[int]) -> bool:
        key = ("exit", tuple(sorted(ranks)))
        return self.world.meet(key, self.rank, len(ranks), None, timeout_s=timeout_s) is not None

    def raise_alarm(self, payload: Any, ranks: Sequence[int]) -> None:
        self.world.post_alarm(self.rank, payload, ranks)

    def poll_alarm(self) -> tuple[int, Any] | None:
        return self.world.take_alarm(self.rank)

    def acknowledge(self, rank: int) -> None:
        self.world.ack(self.rank, rank)

    def acknowledged(self) -> set[int]:
        return self.world.acks_of(self.rank)

    def abort(self, code: int) -> None:
        self.world.aborts.append((self.rank, code))

    def end_process(self, status: int) -> None:
        self.world.exits.append((self.rank, status))


class _MemoryAnd(Pending):
    """One rank's bitwise AND at a meeting of a :class:`World`."""

    def __init__(
        self, world: World, key: tuple[object, ...], rank: int, words: np.ndarray,
        failure: BaseException | None = None,
    ) -> None:
        self._world = world
        self._key = key
        self._rank = rank
        self._result = words.copy()
        self._failure = failure
        self._done = False

    def test(self) -> bool:
        if self._failure is not None:
            raise self._failure
        if not self._done:
            values = self._world.collect(self._key, self._world.size, held=self._rank)
            if values is None:
                return False
            for other in values.values():
                self._result &= other
            self._done = True
        return True

    def wait(self, timeout_s: float) -> None:
        self._world.pause(self._key, self._world.size, timeout_s)

    def result(self) -> np.ndarray:
        return self._result


class MemoryCommunicator(Communicator):
    """A data communicator of some ranks of a :class:`World` (CPU tensors)."""

    fail_next: BaseException | None = None
    """Raised (once) by the next collective: a failure on this rank only."""

    def __init__(
        self, world: World, channel: tuple[object, ...], ranks: tuple[int, ...], rank: int
    ) -> None:
        self.ranks = ranks
        self.rank = ranks.index(rank)
        self.size = len(ranks)
        self._endpoint = _Endpoint(world, channel, self.rank, self.size)

    def _all(self, value: Any) -> list[Any]:
        failure, self.fail_next = self.fail_next, None
        if failure is not None:
            raise failure
        return self._endpoint.all(value)

    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        values = self._all(tensor_in.detach().clone())
        result = values[0]
        for value in values[1:]:
            result = _REDUCE[op](result, value)
        tensor_out.copy_(result)

    def allgather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, counts: Sequence[int]
    ) -> None:
        values = self._all(tensor_in.detach().reshape(-1)[: counts[self.rank]].clone())
        tensor_out.view(-1)[: sum(counts)].copy_(torch.cat(values))

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        tensor.copy_(self._all(tensor.detach().clone())[root])

    def alltoall(
        self,
        tensor_in: torch.Tensor,
        send_counts: Sequence[int],
        tensor_out: torch.Tensor,
        recv_counts: Sequence[int],
    ) -> None:
        flat = tensor_in.detach().reshape(-1)
        chunks = list(torch.split(flat[: sum(send_counts)].clone(), list(send_counts)))
        values = self._all(chunks)
        tensor_out.view(-1)[: sum(recv_counts)].copy_(
            torch.cat([values[r][self.rank] for r in range(self.size)])
        )

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor,
        counts: Sequence[int],
        op: ReduceOp,
    ) -> None:
        values = self._all(tensor_in.detach().reshape(-1).clone())
        total = values[0]
        for value in values[1:]:
            total = _REDUCE[op](total, value)
        start = sum(counts[: self.rank])
        tensor_out.view(-1)[: counts[self.rank]].copy_(total[start : start + counts[self.rank]])

    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        raise NotImplementedError("the in-process world has no point-to-point transfers")

    def barrier(self) -> None:
        self._all(None)


def run_on_ranks(size: int, body: Callable[[int], T], timeout_s: float = 30.0) -> list[T]:
    """Runs ``body(rank)`` on ``size`` threads at once; returns the results by rank and
    re-raises the first rank's exception."""
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"a rank did not finish within {timeout_s} s")
    for error in errors:
        if error is not None:
            raise error
    return results


@dataclasses.dataclass
class Job:
    """A started in-process job: one engine per rank over one world."""

    world: World
    engines: list[Engine]
    controls: list[MemoryControlPlane]

    @property
    def size(self) -> int:
        return self.world.size

    def run(self, body: Callable[[int, Engine], T], timeout_s: float = 30.0) -> list[T]:
        """``body(rank, engine)`` on every rank at once (see :func:`run_on_ranks`)."""
        return run_on_ranks(self.size, lambda r: body(r, self.engines[r]), timeout_s)

    def data_comm(self, rank: int, process_set_id: int = 0) -> MemoryCommunicator:
        comm = self.engines[rank].process_sets[process_set_id].comm
        assert isinstance(comm, MemoryCommunicator)
        return comm

    def close(self) -> None:
        """Shuts every engine down (together, as at the end of a script), then ends every
        wait that a failed job left behind."""
        try:
            self.run(lambda rank, engine: engine.shutdown(timeout=2.0))
        finally:
            self.world.close()


def start_job(
    size: int, device_comms: Callable[[int], DeviceCommFactory] | None = None,
    clock: SteppedClock | None = None, **config: Any,
) -> Job:
    """Builds and starts one engine per rank (what ``init()`` does, collectively).

    ``device_comms(rank)``, when given, is the factory of that rank's device communicators;
    ``clock``, when given, is the time the engines pause on between cycles.
    ``config`` overrides :class:`Config` fields; the defaults here never give up on a peer
    (the ranks share one process) and wait at most two seconds at exit.
    """
    settings = {"peer_timeout_s": 0.0, "exit_timeout_s": 2.0, **config}
    cfg = dataclasses.replace(Config(), **settings)
    world = World(size)
    controls = [MemoryControlPlane(world, rank) for rank in range(size)]

    def build(rank: int) -> Engine:
        engine = Engine(
            cfg, controls[rank], None if device_comms is None else device_comms(rank),
            SYSTEM_CLOCK if clock is None else clock.for_rank(rank),
        )
        engine.start()
        return engine

    engines = run_on_ranks(size, build)
    return Job(world, engines, controls)
