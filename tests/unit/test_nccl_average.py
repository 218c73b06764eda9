"""Average allreduces and reducescatters of CUDA tensors, against a fake CuPy.

By default an Average is a Sum followed by one scaling pass in float64, Horovod's numbers.
With ``ncclAvg`` asked for (BAGUAHVD_NCCL_AVERAGE) and NCCL 2.10 or later, an Average
allreduce of floating tensors without a postscale is one ``allReduce`` with NCCL's average
op and no scaling pass; with an older NCCL, a postscale or an integer dtype it stays a Sum
followed by a scaling pass. The fake NCCL moves no data and
averages as if the other rank had sent zeros, so both ways give this rank's values over the
communicator's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch

from baguahvd.backends import cuda_support
from baguahvd.backends import nccl as backend
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.execution import execute
from baguahvd.engine.messages import OpType, RequestMeta, dtype_name
from baguahvd.engine.requests import Request
from tests.fakes import fake_mpi
from tests.fakes.fake_cupy import NCCL_OPS, NCCL_TYPES, FakeCupy
from tests.fakes.responses import agreed

pytestmark = pytest.mark.bookkeeping

DEVICE = torch.device("cuda", 0)
NEW, OLD = 21805, 20907
AVG, SUM = NCCL_OPS["NCCL_AVG"], NCCL_OPS["NCCL_SUM"]
TYPE_NAMES = {
    torch.float16: "NCCL_FLOAT16", torch.bfloat16: "NCCL_BFLOAT16",
    torch.float32: "NCCL_FLOAT32", torch.float64: "NCCL_FLOAT64",
}


def _install(monkeypatch: pytest.MonkeyPatch, version: int, avg: bool = True) -> FakeCupy:
    fake = FakeCupy(version=version, avg=avg)
    fake.install(monkeypatch)
    monkeypatch.setattr(cuda_support, "tensor_device", lambda tensor: DEVICE)
    monkeypatch.setattr(cuda_support, "current_stream_ptr", lambda device: 0x7070)
    monkeypatch.setattr(cuda_support, "set_torch_device", lambda device: None)
    return fake


def _bound(fake: FakeCupy, native_average: bool = True) -> backend.NCCLCommunicator:
    """Rank 0 of a two-rank communicator whose NCCL communicator exists, log cleared; with
    ``ncclAvg`` asked for unless ``native_average`` is False."""
    comm = backend.NCCLCommunicator(fake_mpi.members(2)[0])
    comm.native_average = native_average
    comm.broadcast(torch.zeros(1), 0)
    fake.log.clear()
    return comm


class _Ops:
    """Records the scaling passes run inside it (:func:`execute.scale_` by a factor other
    than one)."""

    def __init__(self) -> None:
        self.factors: list[float] = []

    def scaling(self) -> list[float]:
        return [factor for factor in self.factors if factor != 1.0]


@contextmanager
def _recording() -> Iterator[_Ops]:
    ops = _Ops()
    original = execute.scale_

    def counting(tensor: torch.Tensor, factor: float) -> None:
        ops.factors.append(factor)
        original(tensor, factor)

    with mock.patch.object(execute, "scale_", counting):
        yield ops


def _allreduce(
    comm: backend.NCCLCommunicator, tensors: list[torch.Tensor], **fields: Any
) -> tuple[list[torch.Tensor], _Ops]:
    dtype = dtype_name(tensors[0].dtype)
    shapes = tuple(tuple(t.shape) for t in tensors)
    response = agreed(
        key="allreduce.g", name="allreduce.g", op=OpType.ALLREDUCE, process_set_id=0,
        dtype=dtype, shapes=shapes, device="GPU", **{"reduce_op": ReduceOp.AVERAGE, **fields},
    )
    meta = RequestMeta(
        key="allreduce.g", name="allreduce.g", op=OpType.ALLREDUCE, process_set_id=0, rank=0,
        dtype=dtype, shapes=shapes, device="GPU",
    )
    # In place, as allreduce_ does: the fake's Sum leaves the buffers as they are.
    inputs = [t.clone() for t in tensors]
    request = Request(meta, inputs, inputs)
    with _recording() as ops:
        execute.allreduce(comm, [(response, request)], execute.FusionBuffers())
    assert request.outputs is not None
    return request.outputs, ops


def _ops_issued(fake: FakeCupy) -> list[int]:
    return [call[6] for call in fake.log.of("allReduce")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("fused", [False, True], ids=["one", "fused"])
def test_average_is_one_ncclavg_call_without_scaling_from_nccl_2_10(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, fused: bool
) -> None:
    fake = _install(monkeypatch, NEW)
    tensors = [torch.tensor([3.0, -1.5, 0.25], dtype=dtype)]
    if fused:
        tensors.append(torch.tensor([[8.0, 6.0]], dtype=dtype))
    outputs, ops = _allreduce(_bound(fake), tensors)
    assert _ops_issued(fake) == [AVG]
    assert fake.log.of("allReduce")[0][5] == NCCL_TYPES[TYPE_NAMES[dtype]]
    assert ops.scaling() == []
    for out, tensor in zip(outputs, tensors):
        assert torch.equal(out, tensor / 2)


def test_average_stays_sum_and_scale_before_nccl_2_10(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch, OLD)
    tensors = [torch.tensor([3.0, -1.5, 0.25]), torch.tensor([8.0, 6.0])]
    outputs, ops = _allreduce(_bound(fake), tensors)
    assert _ops_issued(fake) == [SUM]
    assert len(ops.scaling()) == 1
    assert torch.equal(outputs[0], tensors[0] / 2) and torch.equal(outputs[1], tensors[1] / 2)


def test_cupy_without_the_constant_passes_ncclavgs_value(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch, NEW, avg=False)
    assert not hasattr(fake.cupy.cuda.nccl, "NCCL_AVG")
    outputs, ops = _allreduce(_bound(fake), [torch.tensor([4.0, 2.0])])
    assert _ops_issued(fake) == [4]
    assert torch.equal(outputs[0], torch.tensor([2.0, 1.0]))


def test_a_postscale_keeps_sum_and_one_scaling_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch, NEW)
    tensor = torch.tensor([3.0, -1.5, 0.25])
    outputs, ops = _allreduce(_bound(fake), [tensor], postscale=3.0)
    assert _ops_issued(fake) == [SUM]
    assert len(ops.scaling()) == 1
    assert torch.equal(outputs[0], tensor * (3.0 / 2))


def test_a_prescale_scales_the_inputs_of_ncclavg(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch, NEW)
    tensor = torch.tensor([3.0, -1.5, 0.25])
    outputs, _ = _allreduce(_bound(fake), [tensor], prescale=4.0)
    assert _ops_issued(fake) == [AVG]
    assert torch.equal(outputs[0], tensor * 4.0 / 2)


@pytest.mark.parametrize("version", [NEW, OLD])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int8])
def test_integers_average_as_a_truncated_sum_on_every_nccl(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, version: int
) -> None:
    fake = _install(monkeypatch, version)
    values = [7, 3, 0, 1] if dtype == torch.uint8 else [7, -7, 3, -1]
    tensor = torch.tensor(values, dtype=dtype)
    outputs, _ = _allreduce(_bound(fake), [tensor])
    assert _ops_issued(fake) == [SUM]
    # Horovod's integer average: the sum scaled by 1 / size in float64, truncated.
    assert torch.equal(outputs[0], torch.trunc(tensor.double() * 0.5).to(dtype))


def test_only_floating_types_nccl_reduces_are_averaged_natively(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    comm = backend.NCCLCommunicator(fake_mpi.members(2)[0])
    _install(monkeypatch, NEW)
    # Not unless asked for: ncclAvg does not round as Horovod does.
    assert not comm.reduces_average(torch.float32)
    comm.native_average = True
    assert comm.reduces_average(torch.float16) and comm.reduces_average(torch.bfloat16)
    assert not comm.reduces_average(torch.int32)
    assert not comm.reduces_average(torch.complex64)
    old = backend.NCCLCommunicator(fake_mpi.members(2)[0])
    old.native_average = True
    _install(monkeypatch, OLD)
    assert not old.reduces_average(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_by_default_average_is_a_sum_scaled_in_float64(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    fake = _install(monkeypatch, NEW)
    tensors = [torch.tensor([3.0, -1.5, 0.25], dtype=dtype), torch.tensor([8.0], dtype=dtype)]
    outputs, ops = _allreduce(_bound(fake, native_average=False), tensors)
    assert _ops_issued(fake) == [SUM]
    assert ops.scaling() == [0.5]
    for out, tensor in zip(outputs, tensors):
        assert torch.equal(out, (tensor.double() * 0.5).to(dtype))


def _reducescatter(
    comm: backend.NCCLCommunicator, tensor: torch.Tensor, **fields: Any
) -> tuple[list[torch.Tensor], _Ops]:
    dtype = dtype_name(tensor.dtype)
    shapes = (tuple(tensor.shape),)
    response = agreed(
        key="reducescatter.r", name="reducescatter.r", op=OpType.REDUCESCATTER,
        process_set_id=0, dtype=dtype, shapes=shapes, device="GPU",
        **{"reduce_op": ReduceOp.AVERAGE, **fields},
    )
    meta = RequestMeta(
        key="reducescatter.r", name="reducescatter.r", op=OpType.REDUCESCATTER,
        process_set_id=0, rank=0, dtype=dtype, shapes=shapes, device="GPU",
    )
    with _recording() as ops:
        outputs = execute.reducescatter(comm, response, Request(meta, [tensor], None))
    return outputs, ops


@pytest.mark.parametrize(
    ("version", "fields", "op", "passes"),
    [(NEW, {}, AVG, 0), (OLD, {}, SUM, 1), (NEW, {"postscale": 3.0}, SUM, 1)],
    ids=["ncclavg", "old-nccl", "postscale"],
)
def test_reducescatter_average_uses_ncclavg_where_allreduce_does(
    monkeypatch: pytest.MonkeyPatch, version: int, fields: dict[str, float], op: int,
    passes: int,
) -> None:
    fake = _install(monkeypatch, version)
    outputs, ops = _reducescatter(_bound(fake), torch.ones(4, 3), **fields)
    assert [call[6] for call in fake.log.of("reduceScatter")] == [op]
    assert len(ops.scaling()) == passes
    assert outputs[0].shape == (2, 3)
