"""Engine parts that need no MPI: negotiation messages, the response cache, the
configuration, and the arithmetic of ``baguahvd.engine.execution.execute`` on a one-rank group."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from baguahvd.backends.base import SelfCommunicator
from baguahvd.common.config import Config
from baguahvd.common.exceptions import ShutDownError
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.execution import execute
from baguahvd.engine.execution.completion import CollectiveFailure, Completions
from baguahvd.engine.intake import RequestQueue
from baguahvd.engine.messages import OpType, RequestMeta, Response, build_response, dtype_name
from baguahvd.engine.negotiation.bits import set_bits, slot_bits
from baguahvd.engine.negotiation.cache import Lookup, ResponseCache
from baguahvd.engine.requests import Outcome, Request

# ---------------------------------------------------------------------------------------
# build_response


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
    assert response.op == OpType.ALLREDUCE
    assert response.shapes == ((4, 2),)
    assert response.dtype == "float32"
    assert response.reduce_op == ReduceOp.SUM
    assert response.prescale == 2.0
    assert response.name == "allreduce.w"
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
    assert build_response([_meta(0, fuse=False), _meta(1, fuse=False)], (0, 1), ()).fuse is False
    assert build_response([_meta(0), _meta(1)], (0, 1), ()).fuse is True


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


# ---------------------------------------------------------------------------------------
# ResponseCache


def _response(key: str, process_set_id: int = 0) -> Response:
    return Response(key=key, name=key, op=OpType.ALLREDUCE, process_set_id=process_set_id,
                    dtype="float32", shapes=((4,),))


def test_cache_hit_stale_miss() -> None:
    cache = ResponseCache(4)
    signature = _meta(0).signature()
    cache.put(_response("a"), signature, member=True)
    found, slot = cache.lookup(0, "a", signature)
    assert found is Lookup.HIT and slot == 0
    assert cache.response(slot).key == "a"
    other = _meta(0, shapes=((5,),)).signature()
    assert cache.lookup(0, "a", other) == (Lookup.STALE, 0)
    assert cache.lookup(0, "b", signature) == (Lookup.MISS, -1)
    # Keys are per process set.
    assert cache.lookup(1, "a", signature) == (Lookup.MISS, -1)
    assert len(cache) == 1


def test_cache_lru_eviction_is_deterministic() -> None:
    def run() -> list[tuple[str, int]]:
        cache = ResponseCache(3)
        for key in "abc":
            cache.put(_response(key), None, member=True)
        cache.touch(cache.lookup(0, "a", None)[1])
        cache.put(_response("d"), None, member=True)  # evicts b, the least recently used
        cache.touch(cache.lookup(0, "c", None)[1])
        cache.put(_response("e"), None, member=True)  # evicts a
        return sorted(
            (key, cache.lookup(0, key, None)[1]) for key in "abcde"
            if cache.lookup(0, key, None)[0] is Lookup.HIT
        )

    first = run()
    assert [key for key, _ in first] == ["c", "d", "e"]
    # The freed slots are reused lowest first, so every rank ends with the same layout.
    assert dict(first) == {"c": 2, "d": 1, "e": 0}
    assert run() == first


def test_cache_put_same_key_replaces() -> None:
    cache = ResponseCache(2)
    cache.put(_response("a"), ("old",), member=True)
    cache.put(_response("a"), ("new",), member=True)
    assert len(cache) == 1
    assert cache.lookup(0, "a", ("new",))[0] is Lookup.HIT


@pytest.mark.parametrize(
    "slots",
    [
        [], [0], [7, 8], [1023],
        list(range(0, 1024, 3)),
        [5, 16, 17, 200, 1000, *range(40, 60)],
    ],
)
def test_slot_bits_round_trip(slots: list[int]) -> None:
    # Few slots take the Python path, many the numpy one; both agree with the bytes on the
    # wire: bit s % 8 of byte s // 8.
    bits = slot_bits(set(slots), 128)
    assert set_bits(bits, 128) == sorted(slots)
    wire = bits.to_bytes(128, "little")
    assert [s for s in range(1024) if wire[s // 8] >> (s % 8) & 1] == sorted(slots)


def test_cache_evict_and_not_member_bits() -> None:
    cache = ResponseCache(4)
    cache.put(_response("a", process_set_id=0), None, member=True)
    cache.put(_response("b", process_set_id=7), None, member=False)
    cache.put(_response("c", process_set_id=7), None, member=False)
    assert cache.not_member == 0b0110
    cache.evict_process_set(7)
    assert len(cache) == 1
    assert cache.not_member == 0
    assert cache.lookup(7, "b", None)[0] is Lookup.MISS
    assert cache.lookup(0, "a", None)[0] is Lookup.HIT
    cache.evict(0)
    cache.evict(0)  # evicting an empty slot is harmless
    assert len(cache) == 0


def test_cache_of_capacity_zero_stores_nothing() -> None:
    cache = ResponseCache(0)
    cache.put(_response("a"), None, member=True)
    assert len(cache) == 0
    assert cache.lookup(0, "a", None)[0] is Lookup.MISS


def test_cache_clear() -> None:
    cache = ResponseCache(3)
    for key in "abc":
        cache.put(_response(key), None, member=True)
    cache.clear()
    assert len(cache) == 0
    cache.put(_response("z"), None, member=True)
    assert cache.lookup(0, "z", None) == (Lookup.HIT, 0)


# ---------------------------------------------------------------------------------------
# Config


def test_config_defaults_are_horovods() -> None:
    config = Config.from_env({})
    assert config.fusion_threshold == 128 * 1024 * 1024
    assert config.cycle_time_ms == 1.0
    assert config.cache_capacity == 1024
    assert config.stall_check_time_s == 60.0
    # Deliberately unlike Horovod (which never shuts down): a stall ends the job after 10 min.
    assert config.stall_shutdown_time_s == 600.0
    assert config.dynamic_process_sets is False
    assert config.hierarchical_allreduce is False
    assert config.timeline is None
    assert config.log_level == "warning"
    assert config == Config()


def test_config_reads_horovod_variables() -> None:
    config = Config.from_env({
        "HOROVOD_FUSION_THRESHOLD": "1048576",
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "0",
        "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "true",
        "HOROVOD_TIMELINE": "DYNAMIC",
        "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_THREAD_AFFINITY": "0,2",
    })
    assert config.fusion_threshold == 1048576
    assert config.cycle_time_ms == 2.5
    assert config.cache_capacity == 0
    assert config.dynamic_process_sets is True
    assert config.hierarchical_allreduce is True
    assert config.timeline == "DYNAMIC"
    assert config.log_level == "debug"
    assert config.thread_affinity == (0, 2)


def test_baguahvd_variables_override_horovod_ones() -> None:
    config = Config.from_env({
        "HOROVOD_FUSION_THRESHOLD": "100",
        "BAGUAHVD_FUSION_THRESHOLD": "200",
        "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
        "BAGUAHVD_DYNAMIC_PROCESS_SETS": "0",
        "BAGUAHVD_CYCLE_TIME": "5",
    })
    assert config.fusion_threshold == 200
    assert config.dynamic_process_sets is False
    assert config.cycle_time_ms == 5.0


def test_empty_values_mean_default() -> None:
    config = Config.from_env({"HOROVOD_FUSION_THRESHOLD": "", "HOROVOD_CYCLE_TIME": " "})
    assert config.fusion_threshold == Config.fusion_threshold
    assert config.cycle_time_ms == Config.cycle_time_ms


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("HOROVOD_FUSION_THRESHOLD", "lots"),
        ("HOROVOD_FUSION_THRESHOLD", "-1"),
        ("BAGUAHVD_CYCLE_TIME", "fast"),
        ("HOROVOD_CACHE_CAPACITY", "1k"),
        ("HOROVOD_DYNAMIC_PROCESS_SETS", "maybe"),
        ("HOROVOD_LOG_LEVEL", "loud"),
        ("HOROVOD_THREAD_AFFINITY", "0,x"),
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "soon"),
    ],
)
def test_bad_values_name_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ValueError, match=variable):
        Config.from_env({variable: value})


def test_config_is_frozen() -> None:
    config = Config.from_env({})
    with pytest.raises(AttributeError):
        config.fusion_threshold = 1  # type: ignore[misc]


# ---------------------------------------------------------------------------------------
# execute on a one-rank group


def _allreduce(
    tensors, reduce_op=ReduceOp.SUM, prescale=1.0, postscale=1.0, in_place=False,
    copied=None,
):
    """Runs one (possibly fused) allreduce unit over SelfCommunicator; returns the outputs."""
    entries = []
    for index, tensor in enumerate(tensors):
        meta = RequestMeta(
            key=f"t{index}", name=f"allreduce.t{index}", op=OpType.ALLREDUCE, process_set_id=0,
            rank=0, dtype=dtype_name(tensor.dtype), shapes=(tuple(tensor.shape),),
            reduce_op=reduce_op, prescale=prescale, postscale=postscale,
        )
        output = tensor if in_place else torch.empty_like(tensor)
        request = Request(meta, [tensor], [output])
        entries.append((build_response([meta], (0,), ()), request))
    execute.allreduce(SelfCommunicator(), entries, execute.FusionBuffers(), copied=copied)
    return [request.outputs[0] for _, request in entries]


def test_a_fused_unit_counts_the_bytes_it_copies_in_and_out() -> None:
    copied = execute.ByteCount()
    _allreduce([torch.ones(3), torch.ones(5)], copied=copied)
    assert copied.value == 2 * 8 * 4
    _allreduce([torch.ones(7)], copied=copied)
    assert copied.value == 2 * 8 * 4


def test_a_group_submitted_with_fuse_false_reduces_in_place_without_the_buffer() -> None:
    tensors = [torch.full((3,), 2.0), torch.full((2, 2), 4.0)]
    meta = RequestMeta(
        key="g", name="allreduce.g", op=OpType.ALLREDUCE, process_set_id=0, rank=0,
        dtype="float32", shapes=tuple(tuple(t.shape) for t in tensors), postscale=0.5,
        fuse=False,
    )
    request = Request(meta, tensors, tensors)
    copied = execute.ByteCount()
    buffers = execute.FusionBuffers()
    execute.allreduce(
        SelfCommunicator(), [(build_response([meta], (0,), ()), request)], buffers,
        copied=copied,
    )
    assert copied.value == 0
    assert buffers._buffers == {}
    assert tensors[0].tolist() == [1.0] * 3
    assert tensors[1].tolist() == [[2.0, 2.0]] * 2


@pytest.mark.parametrize("op", [op for op in ReduceOp if op is not ReduceOp.ADASUM])
def test_one_rank_reduction_is_identity(op: ReduceOp) -> None:
    x = torch.tensor([1.5, -2.0, 3.25])
    (out,) = _allreduce([x], op)
    assert torch.equal(out, x)
    assert out is not x


def test_scaling_of_floats() -> None:
    x = torch.tensor([1.0, 2.0, -4.0], dtype=torch.float64)
    (out,) = _allreduce([x], prescale=3.0, postscale=0.25)
    assert torch.equal(out, x * 0.75)
    # The input is not modified by an out-of-place prescale.
    assert torch.equal(x, torch.tensor([1.0, 2.0, -4.0], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_scaling_truncates_toward_zero(dtype: torch.dtype) -> None:
    x = torch.tensor([3, -3, 5, -5, 7], dtype=dtype)
    (out,) = _allreduce([x], prescale=0.5)
    assert out.dtype == dtype
    assert out.tolist() == [1, -1, 2, -2, 3]
    (out,) = _allreduce([x], postscale=0.5)
    assert out.tolist() == [1, -1, 2, -2, 3]
    # Pre- and postscale truncate separately: trunc(trunc(7 * 0.5) * 3) = 9, not 10.
    (out,) = _allreduce([torch.tensor([7], dtype=dtype)], prescale=0.5, postscale=3.0)
    assert out.tolist() == [9]


def test_integer_average_on_one_rank_is_exact() -> None:
    x = torch.tensor([7, -7], dtype=torch.int32)
    (out,) = _allreduce([x], ReduceOp.AVERAGE)
    assert out.tolist() == [7, -7]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_scales_in_float32_and_rounds_once(dtype: torch.dtype) -> None:
    x = torch.tensor([1.0, 3.0, 1000.0, -7.5], dtype=dtype)
    pre, post = 1.0 / 3.0, 3.0
    (out,) = _allreduce([x], prescale=pre, postscale=post)
    assert out.dtype == dtype
    expected = ((x.float() * pre).to(dtype).float() * post).to(dtype)
    assert torch.equal(out, expected)
    (half,) = _allreduce([x], prescale=0.5)
    assert torch.equal(half, torch.tensor([0.5, 1.5, 500.0, -3.75], dtype=dtype))


def test_fused_allreduce_matches_unfused() -> None:
    tensors = [torch.arange(n, dtype=torch.float32) - 2 for n in (1, 5, 12)]
    fused = _allreduce(tensors, prescale=2.0, postscale=0.5)
    for tensor, out in zip(tensors, fused):
        (single,) = _allreduce([tensor], prescale=2.0, postscale=0.5)
        assert torch.equal(out, single)
        assert torch.equal(out, tensor)
    assert [o.shape for o in fused] == [t.shape for t in tensors]


def test_fused_in_place_allreduce() -> None:
    tensors = [torch.full((3, 2), 4, dtype=torch.int32), torch.full((5,), -4, dtype=torch.int32)]
    outputs = _allreduce(tensors, prescale=0.25, in_place=True)
    assert outputs[0] is tensors[0] and outputs[1] is tensors[1]
    assert tensors[0].tolist() == [[1, 1]] * 3
    assert tensors[1].tolist() == [-1] * 5


def test_fused_layouts_are_viewed_once_and_forgotten_when_the_buffer_grows() -> None:
    buffers = execute.FusionBuffers()
    shapes = ((2, 3), (), (4,))
    buffer, views = buffers.views(torch.float32, torch.device("cpu"), shapes)
    assert buffer.numel() == 11 and [tuple(v.shape) for v in views] == list(shapes)
    # The views tile the buffer in order.
    buffer.copy_(torch.arange(11, dtype=torch.float32))
    assert views[0].flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert views[1].item() == 6 and views[2].tolist() == [7, 8, 9, 10]
    again = buffers.views(torch.float32, torch.device("cpu"), shapes)
    assert again[0] is buffer and again[1] is views
    # A larger layout grows the buffer: the old layout's views are made anew on it.
    buffers.views(torch.float32, torch.device("cpu"), ((100,),))
    fresh_buffer, fresh_views = buffers.views(torch.float32, torch.device("cpu"), shapes)
    assert fresh_views is not views
    assert fresh_views[0].data_ptr() == fresh_buffer.data_ptr()
    assert fresh_buffer.data_ptr() != buffer.data_ptr()


def test_repeated_fused_allreduces_reuse_the_layout_with_fresh_tensors() -> None:
    buffers = execute.FusionBuffers()
    for step in range(3):
        tensors = [torch.full((2, 2), float(step)), torch.full((3,), float(-step))]
        entries = []
        for index, tensor in enumerate(tensors):
            meta = RequestMeta(key=f"t{index}", name=f"allreduce.t{index}",
                               op=OpType.ALLREDUCE, process_set_id=0, rank=0,
                               dtype="float32", shapes=(tuple(tensor.shape),))
            entries.append((build_response([meta], (0,), ()),
                            Request(meta, [tensor], [torch.empty_like(tensor)])))
        execute.allreduce(SelfCommunicator(), entries, buffers)
        for (_, request), tensor in zip(entries, tensors):
            assert request.outputs is not None
            assert torch.equal(request.outputs[0], tensor)


def test_a_fusion_buffer_made_in_inference_mode_serves_later_units() -> None:
    buffers = execute.FusionBuffers()
    for inference in (True, False, True):
        with torch.inference_mode(inference):
            tensors = [torch.full((2, 2), 3.0), torch.full((3,), -1.0)]
        entries = []
        for index, tensor in enumerate(tensors):
            meta = RequestMeta(key=f"t{index}", name=f"allreduce.t{index}",
                               op=OpType.ALLREDUCE, process_set_id=0, rank=0,
                               dtype="float32", shapes=(tuple(tensor.shape),))
            with torch.inference_mode(inference):
                output = torch.empty_like(tensor)
            entries.append((build_response([meta], (0,), ()), Request(meta, [tensor], [output])))
        # As the dispatcher runs a unit: in inference mode when one of its tensors is an
        # inference tensor, else without grad.
        with torch.inference_mode() if inference else torch.no_grad():
            execute.allreduce(SelfCommunicator(), entries, buffers)
        for (_, request), tensor in zip(entries, tensors):
            assert request.outputs is not None
            assert torch.equal(request.outputs[0], tensor)


def test_a_handle_tells_the_engine_before_it_blocks() -> None:
    calls: list[int] = []
    handle = Request(_meta(0), [], None).handle
    handle.on_wait = lambda: calls.append(1)
    threading.Timer(0.05, handle.complete, args=([],)).start()
    assert handle.wait() == [] and calls == [1]
    # A finished handle does not block, so the engine is not told.
    assert handle.wait() == [] and calls == [1]


def test_a_blocking_request_wakes_the_engine_when_its_caller_waits() -> None:
    queue = RequestQueue(0)
    asynchronous = Request(_meta(0, name="allreduce.a"), [], None)
    queue.put(asynchronous, lambda: None)
    assert queue.wake.is_set() and not queue.flush.is_set()
    queue.take()
    queue.wake.clear()
    blocking = Request(_meta(0, name="allreduce.b"), [], None)
    queue.put(blocking, lambda: None, blocking=True)
    assert not queue.wake.is_set() and not queue.flush.is_set()
    threading.Timer(0.05, blocking.handle.complete, args=([],)).start()
    assert blocking.handle.wait() == []
    # Its caller waited: the burst is over and the cycle starts.
    assert queue.wake.is_set() and queue.flush.is_set()
    assert [r.meta.name for r in queue.take()] == ["allreduce.b"]


def test_scaled_helper() -> None:
    assert execute.scaled(torch.tensor([5], dtype=torch.int32), 0.5).tolist() == [2]
    assert execute.scaled(torch.tensor([-5], dtype=torch.int64), 0.5).tolist() == [-2]
    assert execute.scaled(torch.tensor([1.5]), 2.0).tolist() == [3.0]


def test_reducescatter_rows_give_the_remainder_to_low_ranks() -> None:
    assert execute.reducescatter_rows(5, 3) == [2, 2, 1]
    assert execute.reducescatter_rows(6, 3) == [2, 2, 2]
    assert execute.reducescatter_rows(2, 3) == [1, 1, 0]
    assert execute.reducescatter_rows(0, 2) == [0, 0]


def test_one_rank_allgather_broadcast_alltoall_reducescatter() -> None:
    comm = SelfCommunicator()
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)

    def request(op: OpType, **fields) -> tuple[Response, Request]:
        meta = _meta(0, op, f"{op.name.lower()}.x", shapes=((3, 2),), **fields)
        return build_response([meta], (0,), ()), Request(meta, [x], [torch.empty_like(x)])

    response, req = request(OpType.ALLGATHER)
    assert torch.equal(execute.allgather(comm, response, req)[0], x)
    response, req = request(OpType.BROADCAST, root=0)
    assert torch.equal(execute.broadcast(comm, response, req)[0], x)
    response, req = request(OpType.ALLTOALL, splits=(2,))
    outputs, received = execute.alltoall(comm, response, req)
    assert received == [2] and torch.equal(outputs[0], x[:2])
    response, req = request(OpType.REDUCESCATTER, reduce_op=ReduceOp.AVERAGE, prescale=2.0)
    assert torch.equal(execute.reducescatter(comm, response, req)[0], x * 2)


# ---------------------------------------------------------------------------------------
# Completions of launched device units


class _Device:
    """A device communicator whose launched units finish when the test says so."""

    def __init__(self) -> None:
        self.fired: set[str] = set()
        self.failure: Exception | None = None
        self.aborted: list[str] = []

    def finished(self, launched: str) -> bool:
        if self.failure is not None:
            raise self.failure
        return launched in self.fired

    def wait(self, launched: str) -> None:
        self.fired.add(launched)

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)


class _Order(list):
    """A timeline stand-in that lists the names of the requests as they complete."""

    active = True

    def done(self, name: str, args: object = None) -> None:
        self.append(name)


def _launched(completions: Completions, comm: _Device, name: str) -> Request:
    request = Request(_meta(0, name=name), [torch.ones(1)], None)
    response = build_response([request.meta], (0, 1), ())
    completions.add(comm, name, [(response, request)], [Outcome(request, [])])
    return request


def _completions() -> tuple[Completions, _Order]:
    order = _Order()
    return Completions(order), order  # type: ignore[arg-type]


def test_launched_units_complete_in_launch_order_across_communicators() -> None:
    completions, order = _completions()
    first, second = _Device(), _Device()
    _launched(completions, first, "a")
    _launched(completions, second, "b")
    second.fired.add("b")
    completions.poll()
    assert order == [] and len(completions) == 2
    first.fired.add("a")
    completions.poll()
    assert order == ["a", "b"] and len(completions) == 0


def test_a_launched_unit_that_fails_names_its_unit() -> None:
    completions, order = _completions()
    comm = _Device()
    request = _launched(completions, comm, "a")
    comm.failure = RuntimeError("NCCL timeout")
    with pytest.raises(CollectiveFailure, match="NCCL timeout") as info:
        completions.poll()
    assert info.value.unit[0][1] is request


def test_waiting_for_the_next_cycle_completes_units_that_finish_meanwhile() -> None:
    completions, order = _completions()
    comm = _Device()
    _launched(completions, comm, "a")
    threading.Timer(0.01, lambda: comm.fired.add("a")).start()
    completions.wait(threading.Event(), 2.0)
    assert order == ["a"]


def test_abandoned_units_abort_their_communicator_and_fail_their_handles() -> None:
    completions, order = _completions()
    comm = _Device()
    requests = [_launched(completions, comm, name) for name in "ab"]
    completions.abandon(ShutDownError())
    assert len(comm.aborted) == 1 and order == []
    for request in requests:
        with pytest.raises(ShutDownError):
            request.handle.wait()


# ---------------------------------------------------------------------------------------
# How an abort is announced


def test_an_abort_is_logged_with_the_transport_that_ends_the_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from baguahvd.backends.gloo.control import GlooControlPlane
    from baguahvd.backends.mpi.control import MPIControlPlane
    from baguahvd.engine.lifecycle.states import Lifecycle

    codes: list[int] = []

    class Control:
        abort_name = GlooControlPlane.abort_name

        def abort(self, code: int) -> None:
            codes.append(code)

    lifecycle = Lifecycle(0, 2, Control(), 1.0, lambda error: None)  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="baguahvd"):
        lifecycle.abort("rank 1 was lost")
    assert codes == [1]
    assert "ending the job with a gloo abort" in caplog.text
    assert "MPI_Abort" not in caplog.text
    assert MPIControlPlane.abort_name == "MPI_Abort"
