"""The arithmetic of every collective (``baguahvd.engine.execution.execute``) on a one-rank
group, and the fusion buffers it copies through."""

from __future__ import annotations

import pytest
import torch

from baguahvd.backends.base import SelfCommunicator
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.execution import execute
from baguahvd.engine.messages import OpType, RequestMeta, Response, build_response, dtype_name
from baguahvd.engine.requests import Request


def _meta(rank: int, op: OpType = OpType.ALLREDUCE, name: str = "allreduce.w", **fields):
    fields.setdefault("dtype", "float32")
    fields.setdefault("shapes", ((4, 2),))
    return RequestMeta(key=name, name=name, op=op, process_set_id=0, rank=rank, **fields)


def _allreduce(
    tensors, reduce_op=ReduceOp.SUM, prescale=1.0, postscale=1.0, in_place=False,
    copied=None, buffers=None,
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
    execute.allreduce(
        SelfCommunicator(), entries, buffers or execute.FusionBuffers(), copied=copied
    )
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


@pytest.mark.parametrize("shaped", [False, True])
def test_flat_cpu_tensors_go_into_the_fusion_buffer_by_one_cat(
    monkeypatch: pytest.MonkeyPatch, shaped: bool
) -> None:
    real_cat = torch.cat
    cats = []

    def cat(tensors, *args, **kwargs):
        cats.append(len(tensors))
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", cat)
    tensors = [torch.arange(n, dtype=torch.float32) + n for n in (2, 3, 4)]
    if shaped:
        tensors[1] = tensors[1].view(1, 3)
    buffers = execute.FusionBuffers()
    outputs = _allreduce(tensors, prescale=2.0, buffers=buffers)
    # A tensor of more than one dimension takes the copy per view instead.
    assert cats == ([] if shaped else [3])
    assert [o.tolist() for o in outputs] == [(2 * t).tolist() for t in tensors]
    flat = real_cat([t.reshape(-1) for t in tensors])
    assert torch.equal(buffers.get(torch.float32, 9, torch.device("cpu")), 2 * flat)


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
