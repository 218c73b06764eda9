"""The fusion plan (``baguahvd.engine.execution.fusion``): which agreed allreduces share a
unit."""

from __future__ import annotations

import pytest

from baguahvd.backends.base import SelfCommunicator
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.execution.fusion import FusionPlans, plan_fusion, unfused_sizes
from baguahvd.engine.messages import OpType, Response
from baguahvd.engine.process_sets import ProcessSetState
from tests.fakes.responses import agreed, redescribed


def _allreduce(name: str, count: int, **fields: object) -> tuple[Response, str]:
    settings: dict[str, object] = {"dtype": "float32", "shapes": ((count,),), **fields}
    response = agreed(key=name, name=name, op=OpType.ALLREDUCE, process_set_id=0,
                        **settings)  # type: ignore[arg-type]
    return response, name


def _names(units: list[list[tuple[Response, str]]]) -> list[list[str]]:
    return [[own for _, own in unit] for unit in units]


def test_small_allreduces_of_one_kind_share_a_unit() -> None:
    entries = [_allreduce("a", 4), _allreduce("b", 4), _allreduce("c", 4)]
    assert _names(plan_fusion(entries, threshold=1024)) == [["a", "b", "c"]]


def test_a_unit_closes_at_the_threshold() -> None:
    # 4 float32 elements are 16 bytes: two fit in 32 bytes, the third opens a new unit.
    entries = [_allreduce("a", 4), _allreduce("b", 4), _allreduce("c", 4)]
    assert _names(plan_fusion(entries, threshold=32)) == [["a", "b"], ["c"]]


def test_no_threshold_fuses_nothing() -> None:
    entries = [_allreduce("a", 1), _allreduce("b", 1)]
    assert _names(plan_fusion(entries, threshold=0)) == [["a"], ["b"]]


@pytest.mark.parametrize(
    "fields",
    [
        {"dtype": "float64"},
        {"reduce_op": ReduceOp.MAX},
        {"prescale": 2.0},
        {"postscale": 0.5},
        {"device": "GPU"},
        {"process_set_id": 1},
    ],
)
def test_allreduces_that_differ_in_kind_are_not_fused(fields: dict[str, object]) -> None:
    first = _allreduce("a", 1)
    response = redescribed(first[0], **fields)
    entries = [first, (redescribed(response, key="b", name="b"), "b"), _allreduce("c", 1)]
    # "c" joins "a"'s unit, which stays open past the different "b".
    assert _names(plan_fusion(entries, threshold=1024)) == [["a", "c"], ["b"]]


def test_errors_adasum_and_other_collectives_run_alone() -> None:
    gather = agreed(key="g", name="g", op=OpType.ALLGATHER, process_set_id=0,
                      dtype="float32", shapes=((1,),))
    entries = [
        _allreduce("a", 1),
        _allreduce("bad", 1, error="mismatch"),
        _allreduce("adasum", 1, reduce_op=ReduceOp.ADASUM),
        (gather, "g"),
        _allreduce("b", 1),
    ]
    assert _names(plan_fusion(entries, threshold=1024)) == [
        ["a", "b"], ["bad"], ["adasum"], ["g"]
    ]


def test_allreduces_submitted_with_fuse_false_run_alone() -> None:
    entries = [
        _allreduce("a", 1),
        _allreduce("own", 1, fuse=False),
        _allreduce("own_group", 0, shapes=((1,), (2,)), fuse=False),
        _allreduce("b", 1),
    ]
    assert _names(plan_fusion(entries, threshold=1024)) == [
        ["a", "b"], ["own"], ["own_group"]
    ]


def test_grouped_allreduces_run_alone_when_group_fusion_is_disabled() -> None:
    grouped = _allreduce("group", 0, shapes=((1,), (2,)))
    entries = [_allreduce("a", 1), grouped, _allreduce("b", 1)]
    assert _names(plan_fusion(entries, threshold=1024)) == [["a", "group", "b"]]
    assert _names(plan_fusion(entries, threshold=1024, disable_group_fusion=True)) == [
        ["a", "b"], ["group"]
    ]


def test_large_cpu_tensors_run_alone_from_their_sets_unfused_size() -> None:
    # 64 float32 elements are 256 bytes: at the unfused size, so "big" skips the buffer.
    entries = [_allreduce("a", 4), _allreduce("big", 64), _allreduce("b", 4),
               _allreduce("just_under", 63)]
    # It also goes first: its transfer starts before the small tensors' call.
    assert _names(plan_fusion(entries, threshold=1 << 20, unfused={0: 256})) == [
        ["big"], ["a", "b", "just_under"]
    ]


def test_a_large_tensor_passes_its_sets_fused_units_only() -> None:
    entries = [
        _allreduce("a", 4),
        (redescribed(_allreduce("gathered", 4)[0], op=OpType.ALLGATHER), "gathered"),  # stops it
        _allreduce("c", 4, dtype="float64"),  # a fused unit opened after it: passed
        (redescribed(_allreduce("other", 4)[0], process_set_id=1), "other"),  # passed over
        _allreduce("big", 64),
        _allreduce("d", 4),  # joins "a"'s unit, which is older than everything here
        _allreduce("big2", 64),
    ]
    assert _names(plan_fusion(entries, threshold=1 << 20, unfused={0: 256})) == [
        ["a", "d"], ["gathered"], ["big"], ["big2"], ["c"], ["other"]
    ]


def test_large_tensors_keep_their_order_among_themselves() -> None:
    entries = [_allreduce("big1", 64), _allreduce("a", 4), _allreduce("big2", 64),
               _allreduce("big3", 128)]
    assert _names(plan_fusion(entries, threshold=1 << 20, unfused={0: 256})) == [
        ["big1"], ["big2"], ["big3"], ["a"]
    ]


@pytest.mark.parametrize(
    ("replaced", "unfused"),
    [
        ({"device": "GPU"}, {0: 256}),  # device copies are cheap: fused as before
        ({"shapes": ((64,), (1,))}, {0: 256}),  # a grouped allreduce stays one unit
        ({}, {0: 0}),  # BAGUAHVD_UNFUSED_BYTES=0: Horovod's plan
        ({}, {1: 256}),  # another set's size does not apply
        ({}, {}),
    ],
)
def test_large_tensors_stay_fused_outside_the_rule(
    replaced: dict[str, object], unfused: dict[int, int]
) -> None:
    big, small = _allreduce("big", 64)[0], _allreduce("a", 4)[0]
    device = {"device": replaced["device"]} if "device" in replaced else {}
    entries = [(redescribed(big, **replaced), "big"), (redescribed(small, **device), "a")]
    assert _names(plan_fusion(entries, threshold=1 << 20, unfused=unfused)) == [["big", "a"]]


def test_unfused_sizes_come_from_the_communicators_unless_configured() -> None:
    class Slow(SelfCommunicator):
        unfused_bytes = 8 << 20

    sets = {
        0: ProcessSetState(0, [0, 1], Slow()),
        1: ProcessSetState(1, [0], SelfCommunicator()),
        2: ProcessSetState(2, [1], None),  # not a member: nothing runs here
    }
    assert unfused_sizes(sets, None) == {0: 8 << 20, 1: 0}
    assert unfused_sizes(sets, 0) == {0: 0, 1: 0}
    assert unfused_sizes(sets, 4096) == {0: 4096, 1: 4096}


def test_fusion_plans_reuse_a_recurring_cycle_s_plan_and_tell_apart_other_responses() -> None:
    responses = [
        _allreduce(f"t{i}", 16 if i % 5 else 150, dtype="float32" if i % 7 else "float64")[0]
        for i in range(40)
    ]
    entries = [(response, f"own{i}") for i, response in enumerate(responses)]
    plans = FusionPlans()
    first = plans.plan(entries, 1024, False, {0: 512})
    assert first == plan_fusion(entries, 1024, False, {0: 512})
    assert len(first) > 3
    # The same responses again, carrying other requests: the kept plan, with the new ones.
    again = [(response, f"next{i}") for i, response in enumerate(responses)]
    assert plans.plan(again, 1024, False, {0: 512}) == plan_fusion(again, 1024, False, {0: 512})
    assert len(plans._plans) == 1
    # Other arguments, or other responses (equal but distinct, or in another order), plan
    # anew.
    assert plans.plan(entries, 256, False, {0: 512}) == plan_fusion(entries, 256, False, {0: 512})
    swapped = [entries[5], *entries[:5], *entries[6:]]
    assert plans.plan(swapped, 1024) == plan_fusion(swapped, 1024)
    copies = [(response._replace(), own) for response, own in entries]
    assert plans.plan(copies, 1024) == plan_fusion(copies, 1024)
    assert len(plans._plans) == 4
    # Only the last few plans are kept; small cycles are planned without keeping.
    for threshold in range(FusionPlans.KEPT + 1):
        plans.plan(entries, 2000 + threshold)
    assert len(plans._plans) == FusionPlans.KEPT
    plans.plan(entries[: FusionPlans.MIN_ENTRIES - 1], 64)
    assert len(plans._plans) == FusionPlans.KEPT
