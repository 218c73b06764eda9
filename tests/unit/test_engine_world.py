"""The engine's cycle in one process: N ranks as threads over an in-memory control plane.

Negotiation, the response cache, join, process sets, stalls and failure propagation run on
real engines (see ``tests/fakes/world.py``), without MPI.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from baguahvd.backends.base import Communicator, Started
from baguahvd.common.exceptions import (
    HorovodInternalError,
    MismatchError,
    PeerFailureError,
    ShutDownError,
    StallError,
)
from baguahvd.common.ops import ReduceOp
from baguahvd.engine import loop
from baguahvd.engine.engine import GLOBAL_PROCESS_SET_ID, Engine
from baguahvd.engine.intake import RequestQueue
from baguahvd.engine.lifecycle.states import State
from baguahvd.engine.messages import OpType, RequestMeta
from baguahvd.engine.negotiation.negotiator import IDLE_PAUSE_MAX_S
from baguahvd.engine.requests import Handle
from tests.fakes.clock import SteppedClock
from tests.fakes.world import Job, run_on_ranks, start_job

SIZE = 3


@pytest.fixture
def job() -> Iterator[Job]:
    started = start_job(SIZE)
    try:
        yield started
    finally:
        started.close()


def _allreduce(
    engine: Engine, tensor: torch.Tensor, name: str | None,
    process_set_id: int = GLOBAL_PROCESS_SET_ID, op: ReduceOp = ReduceOp.SUM,
    fuse: bool = True,
) -> Handle:
    out = torch.empty_like(tensor)
    return engine.submit(
        OpType.ALLREDUCE, "allreduce", process_set_id, [tensor], [out], name=name, reduce_op=op,
        fuse=fuse,
    )


def _result(handle: Handle) -> torch.Tensor:
    outputs = handle.wait()
    assert outputs is not None
    return outputs[0]


def test_allreduce_sums_over_every_rank(job: Job) -> None:
    def body(rank: int, engine: Engine) -> torch.Tensor:
        return _result(_allreduce(engine, torch.full((4,), float(rank + 1)), "x"))

    for result in job.run(body):
        assert torch.equal(result, torch.full((4,), 6.0))


def test_every_collective_kind_runs_in_one_cycle(job: Job) -> None:
    def body(rank: int, engine: Engine) -> list[object]:
        value = torch.tensor([float(rank)])
        handles = [
            _allreduce(engine, torch.tensor([float(rank)]), "a", op=ReduceOp.MAX),
            engine.submit(OpType.ALLGATHER, "allgather", 0,
                          [torch.full((rank + 1,), float(rank))], None, name="g"),
            engine.submit(OpType.BROADCAST, "broadcast", 0, [value], [value.clone()],
                          name="b", root=2),
            engine.submit(OpType.BARRIER, "barrier", 0, [], None),
        ]
        return [handle.wait() for handle in handles]

    for allreduced, gathered, broadcast, barrier in job.run(body):
        assert allreduced[0].tolist() == [2.0]
        assert gathered[0].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        assert broadcast[0].tolist() == [2.0]
        assert barrier is None


def test_small_allreduces_copy_through_the_fusion_buffer_unless_submitted_alone(
    job: Job,
) -> None:
    def step(fuse: bool) -> list[tuple[list[float], int]]:
        def body(rank: int, engine: Engine) -> tuple[list[float], int]:
            before = engine.fusion_bytes
            handles = [_allreduce(engine, torch.full((4,), float(rank)), f"t{i}", fuse=fuse)
                       for i in range(3)]
            # One wait for the whole burst: the three are agreed in one cycle.
            results = [_result(handle).sum().item() for handle in reversed(handles)]
            return results, engine.fusion_bytes - before

        return job.run(body)

    for results, copied in step(fuse=False):
        assert results == [12.0] * 3
        assert copied == 0
    fused = False
    # The three meet in one cycle unless a loaded machine splits the burst: retry then.
    for _ in range(20):
        steps = step(fuse=True)
        for results, copied in steps:
            assert results == [12.0] * 3
            # In and out of the buffer, whatever units the cycles made.
            assert copied % (2 * 4 * 4) == 0
        if all(copied > 0 for _, copied in steps):
            fused = True
            break
    assert fused
    for _, copied in step(fuse=False):
        assert copied == 0


def test_ranks_that_disagree_on_fusion_get_a_mismatch(job: Job) -> None:
    def body(rank: int, engine: Engine) -> str:
        with pytest.raises(MismatchError) as info:
            _allreduce(engine, torch.ones(2), "w", fuse=rank != 1).wait()
        return str(info.value)

    messages = job.run(body)
    assert len(set(messages)) == 1
    assert "fusion" in messages[0] and "fuse=False" in messages[0]


def test_unnamed_requests_match_by_order(job: Job) -> None:
    def body(rank: int, engine: Engine) -> list[float]:
        handles = [_allreduce(engine, torch.tensor([float(i * 10 + rank)]), None)
                   for i in range(3)]
        return [_result(h).item() for h in handles]

    for results in job.run(body):
        assert results == [3.0, 33.0, 63.0]


def test_unnamed_bursts_pair_by_order_and_keep_every_rank_s_cache_the_same(job: Job) -> None:
    # Rank 0 waits for each call; the others submit whole bursts, rank 2 with pauses, so
    # that ranks run the same positions from the cache in different cycles. Every result
    # pairs the n-th call of every rank, and the caches hold the same keys in the same slots
    # (a rank that cached a response under another key would pair the wrong calls later).
    shapes = [(2,), (3,), (2,), (2,), (4,)]

    def body(rank: int, engine: Engine) -> list[float]:
        results = []
        for round_ in range(4):
            values = [float(100 * round_ + 10 * i + rank) for i in range(len(shapes) * 6)]
            tensors = [torch.full(shapes[i % len(shapes)], v) for i, v in enumerate(values)]
            if rank == 0:
                results += [_result(_allreduce(engine, t, None)).max().item() for t in tensors]
                continue
            handles = []
            for index, tensor in enumerate(tensors):
                if rank == 2 and index % 7 == 3:
                    time.sleep(0.002)
                handles.append(_allreduce(engine, tensor, None))
            results += [_result(h).max().item() for h in handles]
        return results

    outcomes = job.run(body)
    expected = [3.0 * (100 * round_ + 10 * i) + 3.0 for round_ in range(4) for i in range(30)]
    assert outcomes == [expected] * SIZE
    caches = [engine._loop.negotiation.cache._slots for engine in job.engines]
    assert len(caches[0]) > 1
    assert all(cache == caches[0] for cache in caches)


def test_repeated_collectives_are_answered_from_the_cache(job: Job) -> None:
    def step(rank: int, engine: Engine) -> float:
        return _result(_allreduce(engine, torch.ones(2), "w")).sum().item()

    assert job.run(step) == [6.0] * SIZE
    gathers = job.world.calls["gather"]
    for _ in range(5):
        assert job.run(step) == [6.0] * SIZE
    # Every later step is announced by one bit: nothing reaches rank 0.
    assert job.world.calls["gather"] == gathers


def test_a_changed_shape_is_renegotiated_not_mismatched(job: Job) -> None:
    def step(shape: int) -> list[float]:
        return job.run(lambda rank, engine: _result(
            _allreduce(engine, torch.ones(shape), "w")).sum().item())

    assert step(2) == [6.0] * SIZE
    gathers = job.world.calls["gather"]
    assert step(5) == [15.0] * SIZE
    assert job.world.calls["gather"] > gathers


def test_a_mismatch_raises_on_every_rank_naming_ranks_and_shapes(job: Job) -> None:
    def body(rank: int, engine: Engine) -> str:
        shape = (17, 3) if rank == 1 else (16, 3)
        with pytest.raises(MismatchError) as info:
            _allreduce(engine, torch.ones(shape), "grad").wait()
        return str(info.value)

    messages = job.run(body)
    assert len(set(messages)) == 1
    assert "allreduce.grad" in messages[0]
    assert "[17, 3]" in messages[0] and "[16, 3]" in messages[0]
    # The job goes on afterwards.
    assert job.run(lambda rank, engine: _result(
        _allreduce(engine, torch.ones(1), "after")).item()) == [3.0] * SIZE


def test_joined_ranks_contribute_zeros_and_join_reports_the_last(job: Job) -> None:
    def body(rank: int, engine: Engine) -> tuple[list[float], int]:
        results = []
        steps = rank + 1  # rank 2 has the most batches and joins last
        for step in range(steps):
            results.append(_result(_allreduce(engine, torch.ones(1), f"s{step}")).item())
        join = engine.submit(OpType.JOIN, "join", GLOBAL_PROCESS_SET_ID, [], None)
        join.wait()
        return results, int(join.extra)

    outcome = job.run(body)
    for rank, (results, last) in enumerate(outcome):
        assert results == [3.0, 2.0, 1.0][: rank + 1]
        assert last == 2


def test_a_cached_collective_runs_while_a_rank_has_joined(job: Job) -> None:
    def step(rank: int, engine: Engine) -> float:
        return _result(_allreduce(engine, torch.ones(1), "w")).item()

    assert job.run(step) == [3.0] * SIZE  # now cached everywhere

    def body(rank: int, engine: Engine) -> tuple[float | None, int]:
        value = None if rank == 0 else step(rank, engine)
        join = engine.submit(OpType.JOIN, "join", GLOBAL_PROCESS_SET_ID, [], None)
        join.wait()
        return value, int(join.extra)

    # Rank 0's bit for "w" never comes: ranks 1 and 2 must renegotiate it in full.
    results = job.run(body, timeout_s=5.0)
    assert [value for value, _ in results] == [None, 2.0, 2.0]
    assert len({last for _, last in results}) == 1


def test_a_dynamic_process_set_runs_only_its_members(job: Job) -> None:
    def add(rank: int, engine: Engine) -> int:
        handle = engine.submit(OpType.ADD_PROCESS_SET, "add_process_set", 0, [], None,
                               payload=(0, 2))
        handle.wait()
        return int(handle.extra)

    idents = job.run(add)
    assert len(set(idents)) == 1
    ident = idents[0]

    def body(rank: int, engine: Engine) -> float | None:
        if rank == 1:
            return None
        return _result(_allreduce(engine, torch.tensor([float(rank)]), "sub", ident)).item()

    assert job.run(body) == [2.0, None, 2.0]


def test_a_set_s_collective_and_its_removal_in_one_cycle_leave_the_caches_the_same() -> None:
    # Two slots: "a" of the global set, then "s" of set 1, used last. One cycle then agrees
    # a new "b", set 1's "t" and set 1's removal. Each rank files the cycle's responses
    # before they run, the removed set's entries going first: "b" takes "s"'s slot, as if
    # filed after the removal; "t" is not cached; "a" stays.
    job = start_job(SIZE, cache_capacity=2)
    try:
        ident = job.run(lambda rank, engine: _add_process_set(engine, (0, 2)))[0]

        def run(name: str, process_set_id: int = GLOBAL_PROCESS_SET_ID) -> None:
            job.run(lambda rank, engine: None if rank not in (0, 2) and process_set_id else
                    _result(_allreduce(engine, torch.ones(1), name, process_set_id)))

        run("a")
        run("s", ident)
        before = [dict(engine._loop.negotiation.cache._slots) for engine in job.engines]
        assert sorted(key for _, key in before[0]) == ["allreduce.a", "allreduce.s"]
        job.world.hold()
        job.world.wait_held()
        gathers = job.world.calls["gather"]

        def submit(rank: int, engine: Engine) -> list[Handle]:
            handles = [_allreduce(engine, torch.ones(1), "b")]
            if rank != 1:
                handles.append(_allreduce(engine, torch.ones(1), "t", ident))
            return [*handles, engine.submit(
                OpType.REMOVE_PROCESS_SET, "remove_process_set", GLOBAL_PROCESS_SET_ID, [],
                None, payload=(ident,))]

        # Rank 0 alone calls "s" again: it waits on "s"'s entry, which the removal evicts.
        orphan = _allreduce(job.engines[0], torch.ones(1), "s", ident)
        handles = job.run(submit)
        job.world.release()
        for rank_handles in handles:
            for handle in rank_handles:
                handle.wait()
        with pytest.raises(HorovodInternalError, match=f"process set {ident} was removed"):
            orphan.wait()
        # All three were agreed in one exchange.
        assert job.world.calls["gather"] == gathers + SIZE
        slots = before[0]
        expected = {
            (GLOBAL_PROCESS_SET_ID, "allreduce.a"): slots[(GLOBAL_PROCESS_SET_ID, "allreduce.a")],
            (GLOBAL_PROCESS_SET_ID, "allreduce.b"): slots[(ident, "allreduce.s")],
        }
        for engine in job.engines:
            assert engine._loop.negotiation.cache._slots == expected
            assert ident not in engine.process_sets
    finally:
        job.close()


def _add_process_set(engine: Engine, ranks: tuple[int, ...]) -> int:
    handle = engine.submit(OpType.ADD_PROCESS_SET, "add_process_set", 0, [], None,
                           payload=ranks)
    handle.wait()
    return int(handle.extra)


@pytest.fixture
def stepped() -> Iterator[tuple[Job, SteppedClock]]:
    """A job whose engines pause between cycles on a clock the test steps."""
    clock = SteppedClock()
    started = start_job(SIZE, clock=clock)
    try:
        yield started, clock
    finally:
        started.close()


def _idle_pauses(base: float, count: int) -> list[float]:
    """The pauses of an idle job: the cycle time, doubled after every idle cycle, up to the
    longest pause."""
    return [min(base * 2.0 ** cycle, max(base, IDLE_PAUSE_MAX_S)) for cycle in range(count)]


def test_an_idle_job_pauses_longer_between_cycles_and_a_submission_wakes_it(
    stepped: tuple[Job, SteppedClock],
) -> None:
    job, clock = stepped
    base = job.engines[0].settings.cycle_time_ms / 1000.0
    for _ in range(8):
        clock.step(waiting=SIZE)
    for rank in range(SIZE):
        assert clock.pauses(rank)[:8] == pytest.approx(_idle_pauses(base, 8))
    assert _idle_pauses(base, 8)[-1] == IDLE_PAUSE_MAX_S
    clock.wait_for(waiting=SIZE)
    at, since = clock.now, len(clock.waits)

    def body(rank: int, engine: Engine) -> float:
        return _result(_allreduce(engine, torch.tensor([float(rank)]), "after-idle")).item()

    assert job.run(body) == [3.0] * SIZE
    # Each rank's longest pause ended at its submission: the clock never moved.
    assert clock.now == at
    for rank in range(SIZE):
        paused = [wait for wait in clock.waits[:since] if wait.rank == rank][-1]
        assert paused.timeout_s == pytest.approx(IDLE_PAUSE_MAX_S) and paused.woken


def test_ranks_that_others_wait_for_keep_pausing_until_they_submit(
    stepped: tuple[Job, SteppedClock],
) -> None:
    job, clock = stepped
    base = job.engines[0].settings.cycle_time_ms / 1000.0
    for _ in range(8):
        clock.step(waiting=SIZE)
    clock.wait_for(waiting=SIZE)
    pending = _allreduce(job.engines[0], torch.ones(1), "early")
    since = len(clock.waits)
    # Rank 0 announces its request every cycle without pausing; the others, with nothing
    # of their own pending, go on pausing as long as an idle job does: what rank 0 waits
    # for is their submission, which wakes them.
    for _ in range(10):
        clock.step(waiting=SIZE - 1)
    clock.wait_for(waiting=SIZE - 1)
    assert set(clock.pauses(0, since)) == {0.0}
    for rank in (1, 2):
        assert clock.pauses(rank, since)[:10] == [IDLE_PAUSE_MAX_S] * 10 != [base] * 10
    at = clock.now
    late = [_allreduce(job.engines[r], torch.ones(1), "early") for r in (1, 2)]
    assert [_result(h).item() for h in (pending, *late)] == [3.0, 3.0, 3.0]
    assert clock.now == at  # agreed in the cycle their submissions started


class _Gated(Started):
    """An allreduce carried by a thread of its own, once the test opens the gate."""

    def __init__(self, run: Callable[[], None], gate: threading.Event) -> None:
        self.error: BaseException | None = None

        def carry() -> None:
            gate.wait()
            try:
                run()
            except BaseException as exc:  # noqa: BLE001 - raised by test() and wait()
                self.error = exc

        self._thread = threading.Thread(target=carry, daemon=True)
        self._thread.start()

    def test(self) -> bool:
        if self._thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True

    def wait(self) -> None:
        self._thread.join()
        self.test()


class _Telling(_Gated):
    """A gated allreduce that tells the callbacks given to :meth:`notify` when it has ended,
    as gloo's futures do."""

    def __init__(self, run: Callable[[], None], gate: threading.Event) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] = []
        self._ended = False

        def run_and_tell() -> None:
            try:
                run()
            finally:
                with self._lock:
                    self._ended = True
                    callbacks, self._callbacks = self._callbacks, []
                for callback in callbacks:
                    callback()

        super().__init__(run_and_tell, gate)

    def notify(self, callback: Callable[[], object]) -> bool:
        with self._lock:
            if not self._ended:
                self._callbacks.append(callback)
                return True
        callback()
        return True


class _Launching:
    """A rank's data communicator whose allreduces are started on threads of their own, as
    gloo's are, and held until ``gate`` is set; its other collectives are the inner one's.
    With ``tells``, they tell when they have ended (:class:`_Telling`)."""

    launches_allreduce = True

    def __init__(self, inner: Communicator, gate: threading.Event, tells: bool = False) -> None:
        self.inner, self.gate, self.tells = inner, gate, tells
        self.rank, self.size = inner.rank, inner.size

    def start_allreduce(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp
    ) -> Started:
        kind = _Telling if self.tells else _Gated
        return kind(lambda: self.inner.allreduce(tensor_in, tensor_out, op), self.gate)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_units_still_running_leave_the_job_idle_and_complete_during_its_pause(job: Job) -> None:
    # Every rank's allreduce is agreed and started, then held on the transport's threads:
    # nothing is left to negotiate, so the cycles are idle and the pause grows; the units
    # complete in the pause's wait once the transport lets them finish.
    gate = threading.Event()
    for engine in job.engines:
        state = engine.process_sets[GLOBAL_PROCESS_SET_ID]
        state.comm = _Launching(state.comm, gate)
    handles = [
        _allreduce(engine, torch.full((4,), float(rank + 1)), "held", fuse=False)
        for rank, engine in enumerate(job.engines)
    ]
    negotiations = [engine._loop.negotiation for engine in job.engines]
    _wait_for(lambda: all(n.idle_cycles >= 4 for n in negotiations))
    assert not any(handle.done() for handle in handles)
    gate.set()
    for handle in handles:
        assert torch.equal(_result(handle), torch.full((4,), 6.0))


def test_an_idle_job_pauses_longer_while_its_units_will_tell_when_they_end(
    stepped: tuple[Job, SteppedClock],
) -> None:
    # Units whose transport tells when they end wake the engine themselves: while only
    # they are in flight the idle pause grows past IDLE_PAUSE_MAX_S to PAUSE_WHILE_TOLD_S,
    # and the end of the units wakes every rank without the clock moving.
    job, clock = stepped
    gate = threading.Event()
    for engine in job.engines:
        state = engine.process_sets[GLOBAL_PROCESS_SET_ID]
        state.comm = _Launching(state.comm, gate, tells=True)
    clock.wait_for(waiting=SIZE)
    handles = [
        _allreduce(engine, torch.full((4,), float(rank + 1)), "told", fuse=False)
        for rank, engine in enumerate(job.engines)
    ]
    since = len(clock.waits)
    for _ in range(12):
        clock.step(waiting=SIZE)
    clock.wait_for(waiting=SIZE)
    for rank in range(SIZE):
        pauses = clock.pauses(rank, since)
        assert pauses[-1] == pytest.approx(loop.PAUSE_WHILE_TOLD_S)
        assert max(pauses) == pytest.approx(loop.PAUSE_WHILE_TOLD_S)
    assert not any(handle.done() for handle in handles)
    at = clock.now
    gate.set()
    for handle in handles:
        assert torch.equal(_result(handle), torch.full((4,), 6.0))
    assert clock.now == at
    # With nothing in flight, the idle pause is IDLE_PAUSE_MAX_S again.
    since = len(clock.waits)
    for _ in range(3):
        clock.step(waiting=SIZE)
    for rank in range(SIZE):
        assert clock.pauses(rank, since)[-1] == pytest.approx(IDLE_PAUSE_MAX_S)


def test_jobs_with_process_sets_keep_the_cycle_time_while_idle(
    stepped: tuple[Job, SteppedClock],
) -> None:
    job, clock = stepped
    base = job.engines[0].settings.cycle_time_ms / 1000.0

    def add(rank: int, engine: Engine) -> None:
        engine.submit(OpType.ADD_PROCESS_SET, "add_process_set", 0, [], None,
                      payload=(0, 2)).wait()

    job.run(add)
    clock.wait_for(waiting=SIZE)
    since = len(clock.waits)
    # A set's collective needs every rank's cycle, and nothing wakes the non-members.
    for _ in range(10):
        clock.step(waiting=SIZE)
    clock.wait_for(waiting=SIZE)
    for rank in range(SIZE):
        assert clock.pauses(rank, since)[:10] == [base] * 10


def test_shutdown_on_one_rank_stops_every_rank(job: Job) -> None:
    pending = [_allreduce(job.engines[r], torch.ones(1), "late") for r in (1, 2)]
    job.engines[0].shutdown()
    for handle in pending:
        with pytest.raises(ShutDownError, match="rank 0 shut down"):
            handle.wait()
    with pytest.raises(ShutDownError):
        _allreduce(job.engines[1], torch.ones(1), "later")
    for engine in job.engines:
        assert engine.state is State.STOPPED and not engine.abnormal


def test_a_failing_rank_fails_its_peers_collectives(job: Job) -> None:
    pending = [_allreduce(job.engines[r], torch.ones(1), "x") for r in (0, 2)]
    job.engines[1].fail("RuntimeError: boom")
    for handle in pending:
        with pytest.raises(PeerFailureError) as info:
            handle.wait()
        assert info.value.rank == 1 and "RuntimeError: boom" in str(info.value)
    _wait_for(lambda: all(engine.state is State.FAILED for engine in job.engines))


def test_a_collective_failing_on_one_rank_raises_an_alarm_to_the_others(job: Job) -> None:
    job.data_comm(1).fail_next = MemoryError("no room for the output")

    def body(rank: int, engine: Engine) -> PeerFailureError:
        with pytest.raises(PeerFailureError) as info:
            _allreduce(engine, torch.ones(1), "big").wait()
        return info.value

    errors = job.run(body)
    for error in errors:
        assert error.rank == 1 and "MemoryError: no room for the output" in str(error)
    # Rank 1 left mid-cycle; the others' engine threads wait in the collective it left.
    assert job.engines[1].state is State.LEAVING
    assert job.engines[0].state is State.STUCK and job.engines[2].state is State.STUCK
    _wait_for(lambda: job.world.acks_of(1) == {0, 2})
    assert job.world.aborts == []


def test_ranks_stuck_in_a_collective_that_a_rank_left_meet_it_before_the_abort() -> None:
    job = start_job(SIZE, exit_timeout_s=10.0)
    try:
        job.data_comm(1).fail_next = MemoryError("no room for the output")

        def body(rank: int, engine: Engine) -> None:
            with pytest.raises(PeerFailureError):
                _allreduce(engine, torch.ones(1), "big").wait()

        job.run(body)
        _wait_for(lambda: job.world.acks_of(1) == {0, 2})
        # Rank 0 cannot finish MPI, but its abort waits until every rank has come (each has
        # reported the error by then), the rank that left included.
        left = threading.Event()
        leaving = threading.Thread(
            target=lambda: (job.engines[0].leave_job(), left.set()), daemon=True
        )
        leaving.start()
        time.sleep(0.3)
        assert not left.is_set() and job.world.aborts == []
        run_on_ranks(2, lambda i: job.engines[i + 1].leave_job())
        leaving.join(5.0)
        assert left.is_set()
        assert sorted(job.world.aborts) == [(0, 1), (2, 1)]
        assert job.world.exits == [(1, 1)]
    finally:
        job.close()


def test_a_stall_past_the_shutdown_time_ends_the_job_on_every_rank() -> None:
    job = start_job(SIZE, stall_check_time_s=0.05, stall_shutdown_time_s=0.1)
    try:
        pending = [_allreduce(job.engines[r], torch.ones(1), "lonely") for r in (0, 1)]
        for handle in pending:
            with pytest.raises(StallError) as info:
                handle.wait()
            assert info.value.missing == {"allreduce.lonely": [2]}
        # Rank 2 hears of the shutdown in its own cycle, which may end after the others'.
        _wait_for(lambda: job.engines[2].state is State.FAILED)
        with pytest.raises(StallError):
            _allreduce(job.engines[2], torch.ones(1), "lonely")
    finally:
        job.close()


def test_a_job_ended_by_a_failure_exits_with_status_1_on_every_rank() -> None:
    """Even when every script caught the error: at exit the ranks meet, then each ends its
    process with status 1, never 0 and never depending on timing."""
    job = start_job(SIZE, stall_check_time_s=0.05, stall_shutdown_time_s=0.1)
    try:
        pending = [_allreduce(job.engines[r], torch.ones(1), "lonely") for r in (0, 1)]
        for handle in pending:
            with pytest.raises(StallError):
                handle.wait()
        _wait_for(lambda: all(engine.state is State.FAILED for engine in job.engines))
        for engine in job.engines:
            engine.shutdown()
        job.run(lambda rank, engine: engine.leave_job())
        assert sorted(job.world.exits) == [(r, 1) for r in range(SIZE)]
        assert job.world.aborts == []
    finally:
        job.close()


def test_a_clean_shutdown_leaves_the_exit_status_alone(job: Job) -> None:
    _allreduce(job.engines[0], torch.ones(1), "x")
    job.engines[1].shutdown()
    _wait_for(lambda: all(engine.state is State.STOPPED for engine in job.engines))
    job.run(lambda rank, engine: engine.leave_job())
    assert job.world.exits == [] and job.world.aborts == []


def _lose_rank_1(job: Job) -> list[Handle]:
    """Ranks 0 and 2 wait in an allreduce; rank 0's watchdog finds rank 1's process gone
    (rank 2's cannot: it runs on another node)."""
    pending = [_allreduce(job.engines[r], torch.ones(1), "pending") for r in (0, 2)]
    job.engines[0]._peer_lost(1, "its process is gone")
    return pending


def test_a_lost_peer_reaches_the_survivors_that_cannot_see_it() -> None:
    job = start_job(SIZE, exit_timeout_s=10.0)
    try:
        for handle in _lose_rank_1(job):
            with pytest.raises(PeerFailureError) as info:
                handle.wait()
            assert info.value.rank == 1 and info.value.reason == "its process is gone"
        _wait_for(lambda: job.engines[2].state is State.STUCK)
        # The survivors meet before the abort (each has reported the error by then), and
        # neither waits for the dead rank.
        started = time.monotonic()
        run_on_ranks(2, lambda i: job.engines[2 * i].leave_job())
        assert time.monotonic() - started < 5.0
        assert sorted(job.world.aborts) == [(0, 1), (2, 1)]
    finally:
        job.close()


def test_a_survivor_that_never_leaves_delays_the_abort_by_the_exit_timeout() -> None:
    job = start_job(SIZE, exit_timeout_s=0.3)
    try:
        for handle in _lose_rank_1(job):
            with pytest.raises(PeerFailureError):
                handle.wait()
        started = time.monotonic()
        job.engines[0].leave_job()
        assert 0.3 <= time.monotonic() - started < 5.0
        assert job.world.aborts == [(0, 1)]
    finally:
        job.close()


def test_a_failed_bitwise_and_waits_for_the_watchdog_to_name_the_lost_peer() -> None:
    # gloo fails the exchange as soon as a dead peer's connection closes, with an error that
    # names an address: the engine thread waits a while for its watchdog to name the rank.
    job = start_job(SIZE, exit_timeout_s=10.0)
    try:
        job.controls[0].fail_next = RuntimeError("Connection closed by peer [10.0.0.2]:4242")
        _wait_for(lambda: job.controls[0].fail_next is None)
        time.sleep(0.2)
        for handle in _lose_rank_1(job):
            with pytest.raises(PeerFailureError) as info:
                handle.wait()
            assert info.value.rank == 1 and info.value.reason == "its process is gone"
        # Rank 0's engine thread stopped waiting once the peer was named.
        thread = job.engines[0]._thread
        assert thread is not None
        thread.join(2.0)
        assert not thread.is_alive()
    finally:
        job.close()


def test_a_failed_bitwise_and_that_nobody_explains_ends_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loop, "ATTRIBUTION_S", 0.2)
    job = start_job(SIZE)
    try:
        job.controls[0].fail_next = RuntimeError("Connection closed by peer [10.0.0.2]:4242")
        _wait_for(lambda: job.engines[0].state is State.LEAVING)
        for rank in (1, 2):
            with pytest.raises(PeerFailureError) as info:
                _allreduce(job.engines[rank], torch.ones(1), "x").wait()
            assert info.value.rank == 0 and "Connection closed by peer" in str(info.value)
    finally:
        job.close()


class _ResetNegotiation:
    """A negotiation whose exchange with rank 0 fails as gloo's does once a peer that
    agreed the cycle's AND dies before the gather: the error names an address."""

    def negotiate(self, notice: object) -> None:
        raise RuntimeError("Read error [127.0.0.1]:60122: Connection reset by peer")


def _negotiating_loop() -> tuple[loop.EngineLoop, SimpleNamespace]:
    """An engine loop with only what its exchange with rank 0 uses, and its lifecycle."""
    engine_loop = object.__new__(loop.EngineLoop)
    engine_loop.negotiation = _ResetNegotiation()  # type: ignore[assignment]
    engine_loop.control = SimpleNamespace(threads_multiple=True)  # type: ignore[assignment]
    lifecycle = SimpleNamespace(error=None)
    engine_loop.lifecycle = lifecycle  # type: ignore[assignment]
    return engine_loop, lifecycle


def test_a_failed_negotiation_waits_for_the_watchdog_to_name_the_lost_peer() -> None:
    engine_loop, lifecycle = _negotiating_loop()
    named = threading.Timer(
        0.2, lambda: setattr(lifecycle, "error", PeerFailureError(1, "its process is gone"))
    )
    named.start()
    started = time.monotonic()
    try:
        # The engine gives up with the watchdog's reason, as after a failed AND.
        with pytest.raises(loop._Abandoned):
            engine_loop._negotiate(None)
    finally:
        named.cancel()
    assert 0.2 <= time.monotonic() - started < loop.ATTRIBUTION_S


def test_a_failed_negotiation_that_nobody_explains_raises_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loop, "ATTRIBUTION_S", 0.2)
    engine_loop, _ = _negotiating_loop()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        engine_loop._negotiate(None)
    assert time.monotonic() - started >= 0.2


def _wait_for(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_a_submitted_request_is_described_by_every_field_of_its_meta(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine.submit builds the description as a plain tuple of every field, in order: it
    must be the RequestMeta the fields name."""
    seen: list[Any] = []
    put = RequestQueue.put

    def recorded(self: RequestQueue, request: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(request)
        put(self, request, *args, **kwargs)

    monkeypatch.setattr(RequestQueue, "put", recorded)

    def body(rank: int, engine: Engine) -> None:
        value = torch.ones(4)
        _result(engine.submit(OpType.ALLREDUCE, "allreduce", GLOBAL_PROCESS_SET_ID, [value],
                              [value.clone()], name="described", prescale=2.0))

    job.run(body)
    assert {request.meta.rank for request in seen} == set(range(SIZE))
    for request in seen:
        meta = request.meta
        assert type(meta) is RequestMeta and len(meta) == len(RequestMeta._fields)
        assert meta == RequestMeta(
            key="allreduce.described", name="allreduce.described", op=OpType.ALLREDUCE,
            process_set_id=GLOBAL_PROCESS_SET_ID, rank=meta.rank, dtype="float32",
            shapes=((4,),), device="CPU", reduce_op=ReduceOp.SUM, prescale=2.0,
            postscale=1.0, root=-1, splits=None, payload=(), failure="", site="", fuse=True,
        )
