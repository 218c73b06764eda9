"""The reports' way to rank 0: the merged tables (tally), the tree that carries them and the
coordinator that reads them, against rank 0 reading every rank's report
(``tests/reference/coordinator_oracle.py``), at several job sizes."""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from baguahvd.backends.gloo import GlooControlPlane, GlooWorld
from baguahvd.common.exceptions import MismatchError, StallError
from baguahvd.engine.engine import Engine
from baguahvd.engine.messages import JOIN_KEY, OpType, RequestMeta
from baguahvd.engine.negotiation import tree
from baguahvd.engine.negotiation.coordinator import Coordinator
from baguahvd.engine.negotiation.stall import StallInspector
from baguahvd.engine.negotiation.tally import Submissions, Tally, union
from baguahvd.engine.notices import Notice, NoticeKind, RankReport
from baguahvd.engine.process_sets import ProcessSetState
from tests.fakes.world import MemoryControlPlane, World, run_on_ranks, start_job
from tests.reference.coordinator_oracle import OracleCoordinator

SIZES = (2, 3, 5, 7, 16)


# ---------------------------------------------------------------------------------------
# The tree


@pytest.mark.parametrize("size", range(1, 40))
def test_every_rank_reaches_rank_0_once_through_contiguous_subtrees(size: int) -> None:
    parents = {child: rank for rank in range(size) for child in tree.children(rank, size)}
    assert sorted(parents) == list(range(1, size))
    for rank in range(1, size):
        assert parents[rank] == tree.parent(rank) < rank

    def subtree(rank: int) -> list[int]:
        return [rank] + [r for child in tree.children(rank, size) for r in subtree(child)]

    # Each subtree's ranks in the order merged are the ranks in order: merging in that
    # order is merging in rank order.
    for rank in range(size):
        assert subtree(rank) == list(range(rank, rank + len(subtree(rank))))
    assert len(tree.children(0, size)) == (size - 1).bit_length()


def test_ranges_of_ranks_merge_in_any_order() -> None:
    assert union([0, 2], [2, 5]) == [0, 5]
    assert union([0, 2], [3, 5]) == [0, 2, 3, 5]
    assert union([3, 5], [0, 1, 6, 7]) == [0, 1, 3, 5, 6, 7]
    assert union([3, 5], [0, 3]) == [0, 5]
    assert union([], [1, 2]) == [1, 2]
    merged = Submissions.of(_meta(4), 0.0)
    for rank in (2, 3, 0, 7):
        merged.add(Submissions.of(_meta(rank), 0.0))
    assert list(merged) == [4, 0, 2, 3, 7]
    assert merged.agreed() == _meta(0) and len(merged) == 5 and 7 in merged
    assert 1 not in merged and merged.count_among((0, 1, 2, 5, 7)) == 3


# ---------------------------------------------------------------------------------------
# Merged tables against rank 0 reading every report


def _meta(rank: int, name: str = "allreduce.g0", process_set_id: int = 0,
          **fields: object) -> RequestMeta:
    base = dict(key=name, name=name, op=OpType.ALLREDUCE, process_set_id=process_set_id,
                rank=rank, dtype="float32", shapes=((4, 3),))
    base.update(fields)
    return RequestMeta(**base)  # type: ignore[arg-type]


_VARIATIONS: list[dict[str, object]] = [
    {"dtype": "float64"}, {"shapes": ((5, 3),)}, {"op": OpType.BROADCAST, "root": 0},
    {"failure": "ValueError: bad tensor"}, {"site": "train.py:12"}, {"prescale": 0.5},
    {"shapes": ((4, 3), (2,))}, {"fuse": False},
]


def _scenario(size: int, seed: int, cycles: int = 4) -> Iterator[list[RankReport]]:
    """Reports of ``cycles`` cycles: named requests of the global set and of a set of some
    ranks, submitted in different cycles by different ranks, some never (stalls), some
    that disagree, allgathers of different first dimensions, placeholders, joins."""
    rng = random.Random(seed)
    subset = tuple(range(1, size, 2)) or (0,)
    everyone = tuple(range(size))
    names = [(f"allreduce.g{i}", 0, everyone) for i in range(6)]
    names += [(f"allreduce.s{i}", 1, subset) for i in range(3)]
    names += [("allgather.v", 0, everyone)]
    plan: dict[int, list[tuple[str, int]]] = {r: [] for r in range(size)}
    for name, ident, members in names:
        for rank in members:
            if rng.random() < 0.9:
                plan[rank].append((name, ident))
    joiners = set(rng.sample(range(size), k=min(2, size - 1)))
    for rank in range(size):
        rng.shuffle(plan[rank])
    for cycle in range(cycles):
        reports = []
        for rank in range(size):
            metas, waited = [], []
            for name, ident in plan[rank][cycle::cycles]:
                fields: dict[str, object] = {}
                if name.startswith("allgather"):
                    fields = {"op": OpType.ALLGATHER, "shapes": ((rng.randint(1, 3), 2),)}
                elif rng.random() < 0.15:
                    fields = dict(rng.choice(_VARIATIONS))
                metas.append(_meta(rank, name, ident, **fields))
                waited.append(rng.random())
            if cycle == 0:  # one request every rank sends at once, the last one differently
                dtype = "float64" if rank == size - 1 else "float32"
                metas.append(_meta(rank, "allreduce.mixed", dtype=dtype))
                waited.append(0.0)
            if rank in joiners and cycle == cycles - 2:
                metas.append(RequestMeta(JOIN_KEY, "join", OpType.JOIN, 0, rank))
                waited.append(0.0)
            reports.append(RankReport(metas, waited))
        yield reports


def _sets(size: int, cycle: int) -> dict[int, ProcessSetState]:
    subset = tuple(range(1, size, 2)) or (0,)
    sets = {0: ProcessSetState(0, tuple(range(size)), None)}
    if cycle < 3:  # the set of some ranks is removed before the last cycle
        sets[1] = ProcessSetState(1, subset, None)
    return sets


def _tree_tally(reports: list[RankReport]) -> Tally:
    """What rank 0 receives up the tree, each message pickled as a transport pickles it."""
    size = len(reports)
    tallies: dict[int, Tally] = {}
    for rank in reversed(range(size)):
        tally = Tally.of_reports([reports[rank]])
        for child in tree.children(rank, size):
            tally.add(pickle.loads(pickle.dumps(tallies.pop(child))))
        tallies[rank] = tally
    return tallies[0]


def _inspector() -> StallInspector:
    return StallInspector(warning_s=1.0, shutdown_s=2.0, disabled=False)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("merge", ["gathered", "tree"])
def test_decisions_and_stalls_equal_rank_0_reading_every_report(
    size: int, seed: int, merge: str
) -> None:
    oracle = OracleCoordinator(_inspector())
    coordinator = Coordinator(_inspector(), None)
    errors = 0
    for cycle, reports in enumerate(_scenario(size, seed)):
        sets = _sets(size, cycle)
        tally = Tally.of_reports(reports) if merge == "gathered" else _tree_tally(reports)
        now = 100.0 + cycle
        expected = oracle.decide(reports, sets, size, now)
        decision = coordinator.decide(tally, sets, size, now)
        assert decision == expected
        errors += sum(response.error is not None for response in decision.responses)
        assert list(coordinator.table) == list(oracle.table)
        for ident, submitted in oracle.table.items():
            assert dict(coordinator.table[ident]) == submitted
            assert next(iter(coordinator.table[ident])) == next(iter(submitted))
    assert errors  # at least allreduce.mixed
    # The same requests wait, since the same time.
    assert coordinator.inspector._first_seen == oracle.inspector._first_seen
    later = 200.0
    sets = _sets(size, 3)
    assert coordinator.check_stalls(sets, later) == oracle.check_stalls(sets, later)


@pytest.mark.parametrize("size", SIZES)
def test_the_first_notice_wins_and_nothing_else_counts(size: int) -> None:
    reports = [RankReport([_meta(r)], [0.0]) for r in range(size)]
    reports[-1] = reports[-1]._replace(notice=Notice(NoticeKind.SHUTDOWN, size - 1))
    reports[size // 2] = reports[size // 2]._replace(
        notice=Notice(NoticeKind.FAILURE, size // 2, "RuntimeError: x"))
    for tally in (Tally.of_reports(reports), _tree_tally(reports)):
        decision = Coordinator(_inspector(), None).decide(tally, _sets(size, 0), size, 0.0)
        assert decision == OracleCoordinator(_inspector()).decide(
            reports, _sets(size, 0), size, 0.0)
        assert decision.notice == Notice(NoticeKind.FAILURE, size // 2, "RuntimeError: x")
        assert not tally.requests


@pytest.mark.parametrize("size", SIZES)
def test_the_tree_over_the_in_process_world_brings_rank_0_the_same_tally(size: int) -> None:
    reports = next(_scenario(size, seed=1))
    world = World(size)
    controls = [MemoryControlPlane(world, rank) for rank in range(size)]
    tallies = run_on_ranks(size, lambda rank: tree.up_the_tree(controls[rank], reports[rank]))
    assert all(tally is None for tally in tallies[1:])
    assert world.calls.get("send", 0) == size - 1 and "gather" not in world.calls
    sets = _sets(size, 0)
    assert Coordinator(_inspector(), None).decide(tallies[0], sets, size, 0.0) == \
        OracleCoordinator(_inspector()).decide(reports, sets, size, 0.0)


def test_the_in_process_world_refuses_what_gloo_refuses() -> None:
    world = World(3)
    control = MemoryControlPlane(world, 1)
    for peer in (1, 3, -1):
        with pytest.raises(ValueError, match="must be another rank of the job"):
            control.send("x", peer)
        with pytest.raises(ValueError, match="must be another rank of the job"):
            control.recv(peer)


# ---------------------------------------------------------------------------------------
# Engines exchanging up the tree


@pytest.fixture
def tree_always(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree, "TREE_FROM_RANKS", 2)


def _allreduce(engine: Engine, tensor: torch.Tensor, name: str) -> torch.Tensor:
    out = torch.empty_like(tensor)
    handle = engine.submit(OpType.ALLREDUCE, "allreduce", 0, [tensor], [out], name=name)
    outputs = handle.wait()
    assert outputs is not None
    return outputs[0]


@pytest.mark.parametrize("size", (5, 7, 16))
def test_engines_agree_and_name_mismatches_through_the_tree(
    size: int, tree_always: None
) -> None:
    job = start_job(size, cache_capacity=0)
    try:
        sums = job.run(lambda rank, engine: _allreduce(engine, torch.ones(3), "w").tolist())
        assert sums == [[float(size)] * 3] * size
        assert job.world.calls["send"] >= size - 1 and "gather" not in job.world.calls

        def mismatched(rank: int, engine: Engine) -> str:
            shape = (2, 3) if rank in (2, size - 1) else (4, 3)
            with pytest.raises(MismatchError) as raised:
                _allreduce(engine, torch.ones(shape), "bad")
            return str(raised.value)

        messages = job.run(mismatched)
        assert set(messages) == {
            "Mismatched ALLREDUCE tensor shapes for allreduce.bad: rank 0 sent a tensor of "
            "shape [4, 3], but rank 2 sent a tensor of shape [2, 3]."
        }
    finally:
        job.close()


@pytest.mark.parametrize("size", (5, 16))
def test_a_stall_seen_through_the_tree_ends_the_job_naming_the_missing_ranks(
    size: int, tree_always: None
) -> None:
    job = start_job(size, cache_capacity=0, stall_check_time_s=0.2, stall_shutdown_time_s=0.5)
    try:
        def body(rank: int, engine: Engine) -> str:
            if rank in (1, size - 1):
                return ""
            with pytest.raises(StallError) as raised:
                _allreduce(engine, torch.ones(1), "lonely")
            return str(raised.value)

        messages = job.run(body, timeout_s=60)
        assert all(f"allreduce.lonely waits for ranks [1, {size - 1}]" in m
                   for m in messages if m)
    finally:
        job.close()


# ---------------------------------------------------------------------------------------
# Point-to-point messages over gloo


def _on_gloo_ranks(size: int, body: Callable[[GlooControlPlane], Any]) -> list[Any]:
    store = dist.HashStore()

    def rank_main(rank: int) -> Any:
        return body(GlooControlPlane(GlooWorld(store, rank, size, group_timeout_s=30)))

    return run_on_ranks(size, rank_main, timeout_s=60)


def test_gloo_carries_the_tree_and_refuses_what_the_in_process_world_refuses() -> None:
    size = 5
    reports = next(_scenario(size, seed=2))

    def body(control: GlooControlPlane) -> Tally | None:
        for peer in (control.rank, size, -1):
            with pytest.raises(ValueError, match="must be another rank of the job"):
                control.send("x", peer)
        return tree.up_the_tree(control, reports[control.rank])

    tallies = _on_gloo_ranks(size, body)
    assert tallies[0] is not None and tallies[1:] == [None] * (size - 1)
    sets = _sets(size, 0)
    assert Coordinator(_inspector(), None).decide(tallies[0], sets, size, 0.0) == \
        OracleCoordinator(_inspector()).decide(reports, sets, size, 0.0)


def test_gloo_itself_refuses_a_message_to_the_own_rank() -> None:
    """What :func:`~baguahvd.backends.base.check_peer` and the in-process world refuse."""

    def body(control: GlooControlPlane) -> str:
        group = control._group
        with pytest.raises(RuntimeError) as raised:
            group.send([torch.zeros(1)], control.rank, 1).wait()
        return str(raised.value)

    assert all("not connected" in text for text in _on_gloo_ranks(2, body))


@pytest.mark.parametrize("size", SIZES)
def test_joins_over_two_cycles_complete_with_the_same_last_rank(size: int) -> None:
    early = set(range(0, size, 3))
    oracle = OracleCoordinator(_inspector())
    coordinator = Coordinator(_inspector(), None)
    for cycle in range(2):
        reports = [
            RankReport([RequestMeta(JOIN_KEY, "join", OpType.JOIN, 0, rank)], [0.0])
            if (rank in early) == (cycle == 0) else RankReport([], [])
            for rank in range(size)
        ]
        decision = coordinator.decide(_tree_tally(reports), _sets(size, 0), size, 0.0)
        assert decision == oracle.decide(reports, _sets(size, 0), size, 0.0)
    assert decision.responses[-1].last_joined == max(set(range(size)) - early)
