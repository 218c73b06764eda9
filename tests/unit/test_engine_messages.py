"""What ranks agree on (``baguahvd.engine.messages``): a response from the members'
requests, or the mismatch error that names the ranks and the values."""

from __future__ import annotations

import pytest

from baguahvd.common.ops import ReduceOp
from baguahvd.engine.messages import OpType, RequestMeta, build_response


def _meta(rank: int, op: OpType = OpType.ALLREDUCE, name: str = "allreduce.w", **fields):
    fields.setdefault("dtype", "float32")
    fields.setdefault("shapes", ((4, 2),))
    return RequestMeta(key=name, name=name, op=op, process_set_id=0, rank=rank, **fields)


def _error(metas, ranks=None, joined=()) -> str:
    ranks = tuple(range(len(metas))) if ranks is None else ranks
    response = build_response(metas, ranks, joined)
    assert response.error is not None
    return response.error


def test_matching_requests_give_a_runnable_response() -> None:
    metas = [_meta(r, reduce_op=ReduceOp.SUM, prescale=2.0) for r in range(3)]
    response = build_response(metas, (0, 1, 2), ())
    assert response.error is None
    assert response.meta.op == OpType.ALLREDUCE
    assert response.meta.shapes == ((4, 2),)
    assert response.meta.dtype == "float32"
    assert response.meta.reduce_op == ReduceOp.SUM
    assert response.meta.prescale == 2.0
    assert response.meta.name == "allreduce.w"
    assert response.joined == ()


def test_shape_mismatch_names_ranks_and_shapes() -> None:
    metas = [_meta(0, shapes=((16, 3),)), _meta(1, shapes=((17, 3),))]
    assert _error(metas) == (
        "Mismatched ALLREDUCE tensor shapes for allreduce.w: rank 0 sent a tensor of shape "
        "[16, 3], but rank 1 sent a tensor of shape [17, 3]."
    )


def test_mismatch_is_reported_against_the_first_member() -> None:
    metas = [_meta(0), _meta(1), _meta(2, shapes=((5,),))]
    message = _error(metas)
    assert "rank 0 sent a tensor of shape [4, 2]" in message
    assert "rank 2 sent a tensor of shape [5]" in message


def test_dtype_mismatch() -> None:
    message = _error([_meta(0, dtype="int32"), _meta(1, dtype="float32")])
    assert message.startswith("Mismatched data types for allreduce.w:")
    assert "rank 0 had type int32" in message and "rank 1 had type float32" in message


def test_operation_mismatch_comes_first() -> None:
    metas = [_meta(0), _meta(1, op=OpType.ALLGATHER, dtype="int32")]
    message = _error(metas)
    assert "Mismatched operations" in message
    assert "rank 0 did an ALLREDUCE" in message and "rank 1 did an ALLGATHER" in message


def test_reduce_op_mismatch() -> None:
    message = _error([_meta(0, reduce_op=ReduceOp.AVERAGE), _meta(1, reduce_op=ReduceOp.SUM)])
    assert "Mismatched reduction operation" in message
    assert "reduction op 0 (AVERAGE)" in message and "reduction op 1 (SUM)" in message


def test_scale_factor_mismatch() -> None:
    message = _error([_meta(0, prescale=1.0, postscale=0.5), _meta(1, prescale=2.0)])
    assert "Mismatched prescale and/or postscale factors" in message
    assert "rank 0 sent factors (1.0, 0.5)" in message
    assert "rank 1 sent factors (2.0, 1.0)" in message


def test_broadcast_root_mismatch_reports_global_ranks() -> None:
    # Roots travel as ranks within the set; messages translate them to global ranks.
    metas = [
        _meta(1, OpType.BROADCAST, "broadcast.b", root=0),
        _meta(3, OpType.BROADCAST, "broadcast.b", root=1),
    ]
    message = _error(metas, ranks=(1, 3))
    assert "Mismatched BROADCAST root ranks" in message
    assert "rank 1 specified root rank 1" in message
    assert "rank 3 specified root rank 3" in message


def test_device_mismatch() -> None:
    message = _error([_meta(0, device="CPU"), _meta(1, device="GPU:0")])
    assert "CPU/GPU device selection" in message
    assert "device CPU" in message and "device GPU:0" in message


def test_fusion_mismatch() -> None:
    message = _error([_meta(0), _meta(1, fuse=False)])
    assert "Mismatched ALLREDUCE fusion for allreduce.w" in message
    assert "rank 0 sent fuse=True, but rank 1 sent fuse=False" in message


def test_the_agreed_response_keeps_the_requests_fusion() -> None:
    unfused = [_meta(0, fuse=False), _meta(1, fuse=False)]
    assert build_response(unfused, (0, 1), ()).meta.fuse is False
    assert build_response([_meta(0), _meta(1)], (0, 1), ()).meta.fuse is True


def test_group_size_mismatch() -> None:
    message = _error([_meta(0, shapes=((2,),)), _meta(1, shapes=((2,), (3,)))])
    assert "rank 0 sent 1 tensors, but rank 1 sent 2" in message


def test_grouped_member_shape_mismatch_says_which_tensor() -> None:
    metas = [_meta(0, shapes=((2,), (3,))), _meta(1, shapes=((2,), (4,)))]
    assert "(tensor 1 of the group)" in _error(metas)


def test_allgather_first_dimension_may_differ() -> None:
    metas = [
        _meta(r, OpType.ALLGATHER, "allgather.g", shapes=((r + 1, 3), (2 * r, 1)))
        for r in range(3)
    ]
    response = build_response(metas, (0, 1, 2), ())
    assert response.error is None
    assert response.first_dims == ((1, 2, 3), (0, 2, 4))


def test_allgather_rank_mismatch() -> None:
    metas = [
        _meta(0, OpType.ALLGATHER, "allgather.g", shapes=((2, 3),)),
        _meta(1, OpType.ALLGATHER, "allgather.g", shapes=((2, 3, 1),)),
    ]
    message = _error(metas)
    assert "Mismatched ALLGATHER tensor shapes" in message
    assert "rank 0 sent a tensor of rank 2" in message
    assert "rank 1 sent a tensor of rank 3" in message


def test_allgather_non_first_dimension_mismatch() -> None:
    metas = [
        _meta(0, OpType.ALLGATHER, "allgather.g", shapes=((2, 10),)),
        _meta(1, OpType.ALLGATHER, "allgather.g", shapes=((5, 20),)),
    ]
    message = _error(metas)
    assert "rank 0 sent a tensor with dimension 1 equal to 10" in message
    assert "rank 1 sent a tensor with dimension 1 equal to 20" in message


def test_allgather_of_a_scalar_is_an_error() -> None:
    metas = [_meta(r, OpType.ALLGATHER, "allgather.s", shapes=((),)) for r in range(2)]
    assert "tried to ALLGATHER a rank-zero tensor" in _error(metas)


def test_alltoall_keeps_every_members_splits() -> None:
    metas = [
        _meta(r, OpType.ALLTOALL, "alltoall.a", shapes=((3, 2),), splits=(r, 3 - r))
        for r in range(2)
    ]
    response = build_response(metas, (0, 1), ())
    assert response.error is None
    assert response.splits == ((0, 3), (1, 2))


def test_process_set_payload_mismatch() -> None:
    metas = [
        RequestMeta("add", "add_process_set", OpType.ADD_PROCESS_SET, 0, 0, payload=(0, 1)),
        RequestMeta("add", "add_process_set", OpType.ADD_PROCESS_SET, 0, 1, payload=(0, 2)),
    ]
    message = _error(metas)
    assert "rank 0 sent [0, 1], but rank 1 sent [0, 2]" in message


def test_allreduce_with_joined_ranks_is_allowed() -> None:
    response = build_response([_meta(0), _meta(2)], (0, 1, 2), (1,))
    assert response.error is None
    assert response.joined == (1,)


@pytest.mark.parametrize(
    ("op", "text"),
    [
        (OpType.ALLGATHER, "Allgather is not supported with Join at this time. Specify "
                           "sparse_to_dense=True if using DistributedOptimizer"),
        (OpType.BROADCAST, "Broadcast is not supported with Join at this time."),
        (OpType.ALLTOALL, "Alltoall is not supported with Join at this time."),
        (OpType.REDUCESCATTER, "Reducescatter is not supported with Join at this time."),
    ],
)
def test_join_unsupported(op: OpType, text: str) -> None:
    metas = [_meta(0, op, "x.y", splits=(1, 1, 2)), _meta(1, op, "x.y", splits=(1, 1, 2))]
    message = _error(metas, ranks=(0, 1, 2), joined=(2,))
    assert message.startswith(text)
    assert "joined ranks: [2]" in message


def test_mismatch_wins_over_join_error() -> None:
    metas = [
        _meta(0, OpType.ALLGATHER, "g", shapes=((1, 2),)),
        _meta(1, OpType.ALLGATHER, "g", shapes=((1, 3),)),
    ]
    assert "Mismatched ALLGATHER" in _error(metas, ranks=(0, 1, 2), joined=(2,))


def test_identical_placeholders_still_fail_with_their_reasons() -> None:
    # Members that agree in everything still fail when every one of them failed locally.
    metas = [_meta(r, failure="ValueError: bad") for r in range(2)]
    error = _error(metas)
    assert "rank 0 failed its local checks: ValueError: bad" in error
    assert "rank 1 failed its local checks" in error


def test_identical_ragged_rank_zero_tensors_are_still_refused() -> None:
    metas = [_meta(r, op=OpType.ALLGATHER, name="allgather.s", shapes=((),)) for r in range(3)]
    assert "rank-zero tensor" in _error(metas)


@pytest.mark.parametrize(
    "field", [("dtype", "float16"), ("shapes", ((4, 3),)), ("reduce_op", ReduceOp.MAX),
              ("prescale", 0.5), ("root", 1), ("device", "GPU"), ("fuse", False),
              ("site", "train.py:9")],
    ids=lambda f: f[0],
)
def test_a_member_that_differs_in_one_field_is_checked_in_full(field) -> None:
    name, value = field
    metas = [_meta(0, site="train.py:3" if name == "site" else ""), _meta(1),
             _meta(2, **{name: value})]
    if name == "site":
        metas[1] = _meta(1, site="train.py:3")
    assert "rank 2" in _error(metas)
