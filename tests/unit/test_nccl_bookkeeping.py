"""Bookkeeping tests of the NCCL backend, not GPU tests.

They run ``baguahvd.backends.nccl`` against a fake CuPy (``tests/fakes/fake_cupy.py``) that
records every call instead of communicating, and CPU tensors that stand in for CUDA ones.
What they establish: the dtype and op tables, which NCCL calls each collective makes with
which pointers, counts and types, how the unique id travels, the order of the stream and
event operations around a collective, and that NCCL errors and timeouts become named
exceptions instead of hangs. Whether NCCL then moves the right bytes is for
``tests/parallel/test_cuda.py`` on a machine with GPUs.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest
import torch

from baguahvd.backends import cuda_support
from baguahvd.backends import nccl as backend
from baguahvd.common.exceptions import HorovodInternalError
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.execution import execute
from baguahvd.engine.messages import OpType, RequestMeta, Response
from baguahvd.engine.requests import Request
from tests.fakes import fake_mpi
from tests.fakes.fake_cupy import NCCL_OPS, NCCL_STREAM_BASE, NCCL_TYPES, FakeCupy, installed
from tests.fakes.responses import agreed, redescribed

pytestmark = pytest.mark.bookkeeping

TORCH_STREAM = 0x7070
"""The handle that the patched ``current_stream_ptr`` gives for torch's current stream."""
DEVICE = torch.device("cuda", 0)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    return installed(monkeypatch, DEVICE, TORCH_STREAM)


def _comm(size: int = 1, rank: int = 0, **kwargs: float) -> backend.NCCLCommunicator:
    return backend.NCCLCommunicator(fake_mpi.members(size)[rank], **kwargs)


def _bound(fake: FakeCupy, size: int = 1, rank: int = 0,
           **kwargs: float) -> backend.NCCLCommunicator:
    """A communicator whose NCCL communicator exists, with the creation calls cleared."""
    members = fake_mpi.members(size)
    comm = backend.NCCLCommunicator(members[rank], **kwargs)
    if rank != 0:
        members[0].Ibcast(bytearray([1] * 128), root=0)
    token = torch.zeros(1)
    comm.broadcast(token, 0)
    fake.log.clear()
    return comm


def _calls(fake: FakeCupy, *names: str) -> list[tuple[object, ...]]:
    return [entry for entry in fake.log if entry[0] in names]


def _addr(tensor: torch.Tensor, offset: int = 0) -> int:
    return tensor.data_ptr() + offset * tensor.element_size()


# ---------------------------------------------------------------------------------------
# Import discipline


def test_importing_baguahvd_imports_no_cupy() -> None:
    code = (
        "import sys, torch\n"
        "import baguahvd, baguahvd.torch, baguahvd.backends.nccl\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'cupy'], 'cupy imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_communicator_imports_cupy_only_at_its_first_collective(
    fake: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    imported: list[str] = []
    real_import = cuda_support.import_cupy

    def counting_import() -> object:
        imported.append("cupy")
        return real_import()

    monkeypatch.setattr(cuda_support, "import_cupy", counting_import)
    comm = _comm()
    assert imported == [] and fake.log == [] and comm.device is None
    comm.allreduce(torch.ones(3), torch.ones(3), ReduceOp.SUM)
    assert imported == ["cupy"] and comm.device == DEVICE
    comm.allreduce(torch.ones(3), torch.ones(3), ReduceOp.SUM)
    assert imported == ["cupy"]


def test_missing_cupy_raises_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(backend.NCCLUnavailableError, match=r"baguahvd\[cuda12\]") as info:
        cuda_support.import_cupy()
    assert "CuPy is not installed" in str(info.value)
    assert isinstance(info.value, HorovodInternalError)


def test_cupy_without_nccl_raises_the_install_hint(fake: FakeCupy) -> None:
    fake.cupy.cuda.nccl.available = False
    with pytest.raises(backend.NCCLUnavailableError, match="libnccl.so.2 was not found") as info:
        _comm().allreduce(torch.ones(2), torch.ones(2), ReduceOp.SUM)
    assert "pip install nvidia-nccl-cu12" in str(info.value)
    assert "LD_LIBRARY_PATH" in str(info.value)


def test_cupy_whose_nccl_bindings_fail_to_load_says_nccl_is_missing(
    fake: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)
    with pytest.raises(backend.NCCLUnavailableError, match="cannot use NCCL"):
        cuda_support.import_cupy()


# ---------------------------------------------------------------------------------------
# Tables


def test_dtype_table(fake: FakeCupy) -> None:
    table = cuda_support.dtype_table(fake.cupy.cuda.nccl)
    assert table == {
        torch.int8: NCCL_TYPES["NCCL_INT8"],
        torch.uint8: NCCL_TYPES["NCCL_UINT8"],
        torch.int32: NCCL_TYPES["NCCL_INT32"],
        torch.int64: NCCL_TYPES["NCCL_INT64"],
        torch.float16: NCCL_TYPES["NCCL_FLOAT16"],
        torch.bfloat16: NCCL_TYPES["NCCL_BFLOAT16"],
        torch.float32: NCCL_TYPES["NCCL_FLOAT32"],
        torch.float64: NCCL_TYPES["NCCL_FLOAT64"],
    }


@pytest.mark.parametrize(
    ("version", "constant"), [(20907, True), (21003, False)], ids=["nccl-2.9", "old-cupy"]
)
def test_bfloat16_needs_nccl_2_10_and_the_constant(version: int, constant: bool) -> None:
    nccl = FakeCupy(version=version, bfloat16=constant).cupy.cuda.nccl
    assert torch.bfloat16 not in cuda_support.dtype_table(nccl)
    assert torch.float16 in cuda_support.dtype_table(nccl)


@pytest.mark.parametrize("version", [20907, 21003])
def test_op_table(version: int) -> None:
    table = {
        ReduceOp.SUM: NCCL_OPS["NCCL_SUM"],
        ReduceOp.PRODUCT: NCCL_OPS["NCCL_PROD"],
        ReduceOp.MIN: NCCL_OPS["NCCL_MIN"],
        ReduceOp.MAX: NCCL_OPS["NCCL_MAX"],
    }
    if version >= 21000:  # ncclAvg
        table[ReduceOp.AVERAGE] = NCCL_OPS["NCCL_AVG"]
    assert cuda_support.op_table(FakeCupy(version=version).cupy.cuda.nccl) == table


@pytest.mark.parametrize("dtype", [torch.int16, torch.bool, torch.complex64])
def test_unknown_dtype_is_a_type_error_naming_it(fake: FakeCupy, dtype: torch.dtype) -> None:
    tensor = torch.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match=str(dtype)):
        _comm().allreduce(tensor, tensor, ReduceOp.SUM)
    with pytest.raises(TypeError, match=str(dtype)):
        _comm().reduce_scatter(tensor, tensor[:4], [4], ReduceOp.SUM)
    # Refused before anything collective happened.
    assert "NcclCommunicator" not in fake.log.names()
    assert "allReduce" not in fake.log.names()


@pytest.mark.parametrize(
    ("op", "version"), [(ReduceOp.AVERAGE, 20907), (ReduceOp.ADASUM, 21805)]
)
def test_ops_built_by_the_engine_are_refused(
    monkeypatch: pytest.MonkeyPatch, op: ReduceOp, version: int
) -> None:
    FakeCupy(version=version).install(monkeypatch)
    monkeypatch.setattr(cuda_support, "tensor_device", lambda tensor: DEVICE)
    tensor = torch.zeros(4)
    with pytest.raises(ValueError, match=op.name):
        _comm().allreduce(tensor, tensor, op)


@pytest.mark.parametrize(
    ("op", "code"),
    [(ReduceOp.SUM, 0), (ReduceOp.PRODUCT, 1), (ReduceOp.MAX, 2), (ReduceOp.MIN, 3)],
)
@pytest.mark.parametrize(
    ("dtype", "type_code"),
    [(torch.float16, 6), (torch.bfloat16, 9), (torch.float32, 7), (torch.float64, 8),
     (torch.int8, 0), (torch.uint8, 1), (torch.int32, 2), (torch.int64, 4)],
)
def test_allreduce_passes_pointers_count_type_and_op(
    fake: FakeCupy, op: ReduceOp, code: int, dtype: torch.dtype, type_code: int
) -> None:
    comm = _bound(fake)
    tensor_in, tensor_out = torch.zeros(5, dtype=dtype), torch.zeros(5, dtype=dtype)
    comm.allreduce(tensor_in, tensor_out, op)
    assert _calls(fake, "allReduce") == [
        ("allReduce", 0, _addr(tensor_in), _addr(tensor_out), 5, type_code, code,
         NCCL_STREAM_BASE)
    ]


def test_bfloat16_is_reduced_in_float32_before_nccl_2_10(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCupy(version=20907)
    fake.install(monkeypatch)
    monkeypatch.setattr(cuda_support, "tensor_device", lambda tensor: DEVICE)
    monkeypatch.setattr(cuda_support, "current_stream_ptr", lambda device: TORCH_STREAM)
    monkeypatch.setattr(cuda_support, "set_torch_device", lambda device: None)
    tensor_in = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    tensor_out = torch.zeros(3, dtype=torch.bfloat16)
    _comm().allreduce(tensor_in, tensor_out, ReduceOp.SUM)
    _warm_up, call = _calls(fake, "allReduce")
    assert call[4:6] == (3, NCCL_TYPES["NCCL_FLOAT32"])
    assert call[2] == call[3]  # reduced in place in the widened copy
    # The fake reduces nothing, so the widened copy comes back unchanged.
    assert torch.equal(tensor_out, tensor_in)


# ---------------------------------------------------------------------------------------
# Creation: the unique id


def test_the_sets_first_rank_creates_the_unique_id_and_broadcasts_it(fake: FakeCupy) -> None:
    members = fake_mpi.members(3)
    comms = [backend.NCCLCommunicator(member) for member in members]
    assert fake.log == []
    for comm in comms:  # the root first: the fake MPI delivers in call order
        tensor = torch.ones(2)
        comm.allreduce(tensor, tensor, ReduceOp.SUM)
    assert _calls(fake, "get_unique_id") == [("get_unique_id",)]
    # The id travels as bytes over a non-blocking MPI broadcast and reaches the communicator
    # as the bytes CuPy 14 gave (high bits kept).
    sent, root = members[0].ibcasts[0]
    assert root == 0 and len(sent) == 128
    unique_id = bytes(sent)
    assert max(unique_id) > 127
    assert [member.ibcasts for member in members] == [
        [(sent, 0)], [(bytes(128), 0)], [(bytes(128), 0)]
    ]
    assert all(member.bcasts == [] for member in members)
    assert _calls(fake, "NcclCommunicator") == [
        ("NcclCommunicator", 3, unique_id, rank) for rank in range(3)
    ]
    assert [comm.device for comm in comms] == [DEVICE] * 3


def test_the_communicator_is_created_once_on_the_tensors_device(fake: FakeCupy) -> None:
    comm = _comm()
    for _ in range(3):
        comm.broadcast(torch.ones(2), 0)
    assert len(_calls(fake, "NcclCommunicator")) == 1
    assert len(_calls(fake, "Stream")) == 1
    creation = fake.log.names()[: fake.log.names().index("Event.done") + 1]
    # The device is selected once for the calling thread and once for the helper that
    # creates the communicator and warms it up; neither is restored to another one.
    assert creation == [
        "Device.use", "get_unique_id", "Device.use", "NcclCommunicator", "Stream", "alloc",
        "allReduce", "Event.record", "Event.done",
    ]
    assert fake.log[0] == fake.log[2] == ("Device.use", 0)
    assert "Device.exit" not in fake.log.names()
    assert _calls(fake, "Stream") == [("Stream", NCCL_STREAM_BASE, True)]


def test_a_tensor_on_another_device_is_refused(
    fake: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    comm = _bound(fake)
    monkeypatch.setattr(cuda_support, "tensor_device", lambda tensor: torch.device("cuda", 1))
    with pytest.raises(backend.NCCLError, match="set_device"):
        comm.broadcast(torch.ones(2), 0)


def test_creation_failure_is_named(fake: FakeCupy, monkeypatch: pytest.MonkeyPatch) -> None:
    nccl = fake.cupy.cuda.nccl

    def failing(*args: object) -> None:
        raise nccl.NcclError(2)

    monkeypatch.setattr(nccl, "NcclCommunicator", failing)
    with pytest.raises(backend.NCCLError, match="creating the NCCL communicator"):
        _comm().broadcast(torch.ones(2), 0)


def test_helpers_for_local_and_cross_communicators() -> None:
    local, cross = fake_mpi.members(4)[2], fake_mpi.members(2)[1]

    class Topology:
        local_comm = local
        cross_comm = cross

    made_local = backend.local_communicator(Topology(), timeout_s=5)
    made_cross = backend.cross_communicator(Topology())
    assert (made_local.comm, made_local.rank, made_local.size) == (local, 2, 4)
    assert (made_cross.comm, made_cross.rank, made_cross.size) == (cross, 1, 2)
    assert made_local.timeout_s == 5 and made_cross.timeout_s == backend.DEFAULT_TIMEOUT_S


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        _comm(timeout_s=0)


def test_free_destroys_the_nccl_communicator(fake: FakeCupy) -> None:
    comm = _bound(fake)
    comm.free()
    comm.free()
    # Once, after its stream drained (an event recorded and seen done, with CuPy's device
    # selected: the freeing thread may be any).
    assert _calls(fake, "destroy", "abort") == [("destroy", 0)]
    assert fake.log.names()[:3] == ["Device.enter", "Event.record", "Event.done"]


# ---------------------------------------------------------------------------------------
# Streams and events


def test_stream_and_event_order_around_a_collective(fake: FakeCupy) -> None:
    comm = _bound(fake)
    tensor = torch.ones(4)
    comm.allreduce(tensor, tensor, ReduceOp.MAX)
    events = [entry[1] for entry in fake.log if entry[0] == "Event.record"]
    ready, done = events
    assert fake.log == [
        # The NCCL stream waits for what torch's current stream has queued so far...
        ("Event.record", ready, TORCH_STREAM),
        ("Stream.wait_event", NCCL_STREAM_BASE, ready),
        ("allReduce", 0, _addr(tensor), _addr(tensor), 4, 7, 2, NCCL_STREAM_BASE),
        # ...and torch's stream waits for the collective before reading the result.
        ("Event.record", done, NCCL_STREAM_BASE),
        ("Stream.wait_event", TORCH_STREAM, done),
        # The engine thread then watches the completion event; nothing synchronizes the
        # device.
        ("Event.done", done),
    ]


def test_completion_is_polled_until_the_event_fires(fake: FakeCupy) -> None:
    comm = _bound(fake)
    fake.polls_until_done = 4
    comm.broadcast(torch.ones(2), 0)
    assert fake.log.names().count("Event.done") == 5


# ---------------------------------------------------------------------------------------
# Collectives: which NCCL calls, with which pointers and counts


def test_broadcast_is_in_place(fake: FakeCupy) -> None:
    comm = _bound(fake, size=3, rank=1)
    tensor = torch.ones(2, 3, dtype=torch.float64)
    comm.broadcast(tensor, 2)
    assert _calls(fake, "broadcast") == [
        ("broadcast", 1, _addr(tensor), _addr(tensor), 6, 8, 2, NCCL_STREAM_BASE)
    ]


@pytest.mark.parametrize(("dtype", "per_element"), [(torch.int16, 2), (torch.bool, 1)])
def test_types_nccl_lacks_move_as_bytes(
    fake: FakeCupy, dtype: torch.dtype, per_element: int
) -> None:
    comm = _bound(fake, size=2)
    tensor = torch.zeros(5, dtype=dtype)
    comm.broadcast(tensor, 0)
    (call,) = _calls(fake, "broadcast")
    assert call[4:6] == (5 * per_element, NCCL_TYPES["NCCL_UINT8"])


def test_allgather_of_equal_blocks_is_one_call(fake: FakeCupy) -> None:
    comm = _bound(fake, size=3, rank=1)
    tensor_in, tensor_out = torch.ones(4), torch.zeros(12)
    comm.allgather(tensor_in, tensor_out, [4, 4, 4])
    assert _calls(fake, "allGather", "broadcast", "groupStart", "groupEnd") == [
        ("allGather", 1, _addr(tensor_in), _addr(tensor_out), 4, 7, NCCL_STREAM_BASE)
    ]


def test_allgather_of_uneven_blocks_broadcasts_each_block_in_a_group(fake: FakeCupy) -> None:
    comm = _bound(fake, size=4, rank=1)
    tensor_in = torch.ones(3, dtype=torch.int32)
    tensor_out = torch.zeros(9, dtype=torch.int32)
    comm.allgather(tensor_in, tensor_out, [2, 3, 0, 4])
    assert _calls(fake, "broadcast", "groupStart", "groupEnd") == [
        ("groupStart",),
        ("broadcast", 1, _addr(tensor_out, 0), _addr(tensor_out, 0), 2, 2, 0, NCCL_STREAM_BASE),
        # This rank's own block comes from its input.
        ("broadcast", 1, _addr(tensor_in), _addr(tensor_out, 2), 3, 2, 1, NCCL_STREAM_BASE),
        # Rank 2 sends nothing: no call.
        ("broadcast", 1, _addr(tensor_out, 5), _addr(tensor_out, 5), 4, 2, 3, NCCL_STREAM_BASE),
        ("groupEnd",),
    ]


def test_alltoall_is_grouped_send_and_recv(fake: FakeCupy) -> None:
    comm = _bound(fake, size=3, rank=2)
    tensor_in = torch.arange(6, dtype=torch.int64)
    tensor_out = torch.zeros(5, dtype=torch.int64)
    comm.alltoall(tensor_in, [1, 0, 5], tensor_out, [2, 2, 1])
    s = NCCL_STREAM_BASE
    assert _calls(fake, "send", "recv", "groupStart", "groupEnd") == [
        ("groupStart",),
        ("send", 2, _addr(tensor_in, 0), 1, 4, 0, s),
        ("recv", 2, _addr(tensor_out, 0), 2, 4, 0, s),
        ("recv", 2, _addr(tensor_out, 2), 2, 4, 1, s),
        ("send", 2, _addr(tensor_in, 1), 5, 4, 2, s),
        ("recv", 2, _addr(tensor_out, 4), 1, 4, 2, s),
        ("groupEnd",),
    ]


def test_alltoall_of_int16_counts_bytes(fake: FakeCupy) -> None:
    comm = _bound(fake, size=2)
    tensor_in, tensor_out = torch.zeros(3, dtype=torch.int16), torch.zeros(3, dtype=torch.int16)
    comm.alltoall(tensor_in, [1, 2], tensor_out, [1, 2])
    sends = _calls(fake, "send")
    assert [(call[2], call[3], call[4]) for call in sends] == [
        (_addr(tensor_in, 0), 2, 1), (_addr(tensor_in, 1), 4, 1)
    ]


def test_sendrecv_is_one_group(fake: FakeCupy) -> None:
    comm = _bound(fake, size=2, rank=1)
    mine, theirs = torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    comm.sendrecv(mine, theirs, 0)
    s = NCCL_STREAM_BASE
    assert _calls(fake, "send", "recv", "groupStart", "groupEnd") == [
        ("groupStart",),
        ("send", 1, _addr(mine), 3, 8, 0, s),
        ("recv", 1, _addr(theirs), 3, 8, 0, s),
        ("groupEnd",),
    ]


def test_reduce_scatter_of_equal_blocks_is_one_call(fake: FakeCupy) -> None:
    comm = _bound(fake, size=2, rank=1)
    tensor_in, tensor_out = torch.ones(6), torch.zeros(3)
    comm.reduce_scatter(tensor_in, tensor_out, [3, 3], ReduceOp.MIN)
    assert _calls(fake, "reduceScatter", "reduce") == [
        ("reduceScatter", 1, _addr(tensor_in), _addr(tensor_out), 3, 7, 3, NCCL_STREAM_BASE)
    ]


def test_reduce_scatter_of_uneven_blocks_reduces_each_block_to_its_rank(
    fake: FakeCupy,
) -> None:
    comm = _bound(fake, size=3, rank=0)
    tensor_in, tensor_out = torch.ones(7), torch.zeros(3)
    comm.reduce_scatter(tensor_in, tensor_out, [3, 2, 2], ReduceOp.SUM)
    s = NCCL_STREAM_BASE
    assert _calls(fake, "reduce", "groupStart", "groupEnd") == [
        ("groupStart",),
        ("reduce", 0, _addr(tensor_in, 0), _addr(tensor_out), 3, 7, 0, 0, s),
        ("reduce", 0, _addr(tensor_in, 3), _addr(tensor_in, 3), 2, 7, 0, 1, s),
        ("reduce", 0, _addr(tensor_in, 5), _addr(tensor_in, 5), 2, 7, 0, 2, s),
        ("groupEnd",),
    ]


# ---------------------------------------------------------------------------------------
# The engine's arithmetic on the NCCL communicator


def _response(shapes: tuple[tuple[int, ...], ...]) -> Response:
    return agreed(
        key="allreduce.g", name="allreduce.g", op=OpType.ALLREDUCE, process_set_id=0,
        dtype="float32", shapes=shapes, device="GPU", reduce_op=ReduceOp.SUM,
    )


def _request(tensors: list[torch.Tensor]) -> Request:
    meta = RequestMeta(
        key="allreduce.g", name="allreduce.g", op=OpType.ALLREDUCE, process_set_id=0, rank=0,
        dtype="float32", shapes=tuple(tuple(t.shape) for t in tensors), device="GPU",
    )
    return Request(meta, tensors, [t.clone() for t in tensors])


def test_fused_allreduce_is_one_nccl_call_on_the_fusion_buffer(fake: FakeCupy) -> None:
    comm = _bound(fake, size=2)
    request = _request([torch.ones(3), torch.ones(2, 2)])
    buffers = execute.FusionBuffers()
    execute.allreduce(comm, [(_response(((3,), (2, 2))), request)], buffers)
    (call,) = _calls(fake, "allReduce")
    buffer = buffers.get(torch.float32, 7, torch.device("cpu"))
    assert call[2] == call[3] == buffer.data_ptr() and call[4] == 7


def test_a_joined_member_puts_its_zeros_on_the_communicators_gpu(fake: FakeCupy) -> None:
    comm = _bound(fake, size=2)
    assert execute._joined_device(comm, _response(((3,),))) == DEVICE
    cpu = redescribed(_response(((3,),)), device="CPU")
    assert execute._joined_device(comm, cpu) == torch.device("cpu")


# ---------------------------------------------------------------------------------------
# Errors and the watchdog


def test_an_nccl_error_is_named(fake: FakeCupy) -> None:
    comm = _bound(fake)
    fake.fail_call = "allReduce"
    tensor = torch.ones(2)
    with pytest.raises(backend.NCCLError, match="NCCL allreduce on cuda:0 failed") as info:
        comm.allreduce(tensor, tensor, ReduceOp.SUM)
    assert isinstance(info.value, HorovodInternalError)


def test_the_group_is_closed_when_a_call_inside_fails(fake: FakeCupy) -> None:
    comm = _bound(fake, size=2)
    fake.fail_call = "send"
    with pytest.raises(backend.NCCLError, match="sendrecv"):
        comm.sendrecv(torch.ones(2), torch.zeros(2), 1)
    assert fake.log.names().count("groupStart") == fake.log.names().count("groupEnd") == 1


def test_an_asynchronous_error_aborts_and_is_named(fake: FakeCupy) -> None:
    comm = _bound(fake)
    fake.polls_until_done = -1
    fake.async_error = 6
    with pytest.raises(backend.NCCLError, match="aborted") as info:
        comm.broadcast(torch.ones(2), 0)
    assert not isinstance(info.value, backend.NCCLTimeoutError)
    assert ("abort", 0) in fake.log
    assert fake.communicators[0].aborted


def test_a_collective_past_the_timeout_aborts_instead_of_hanging(fake: FakeCupy) -> None:
    comm = _bound(fake, timeout_s=0.05)
    fake.polls_until_done = -1
    tensor = torch.ones(2)
    start = time.monotonic()
    with pytest.raises(backend.NCCLTimeoutError, match=r"within 0.05 s") as info:
        comm.allreduce(tensor, tensor, ReduceOp.SUM)
    assert time.monotonic() - start < 5
    assert isinstance(info.value, backend.NCCLError)
    assert isinstance(info.value, HorovodInternalError)
    assert fake.log.names()[-1] == "abort"
    assert fake.communicators[0].aborted


def test_an_aborted_communicator_refuses_further_collectives(fake: FakeCupy) -> None:
    comm = _bound(fake, timeout_s=0.01)
    fake.polls_until_done = -1
    tensor = torch.ones(2)
    with pytest.raises(backend.NCCLTimeoutError):
        comm.allreduce(tensor, tensor, ReduceOp.SUM)
    fake.polls_until_done = 0
    fake.log.clear()
    with pytest.raises(backend.NCCLError, match="aborted earlier"):
        comm.allreduce(tensor, tensor, ReduceOp.SUM)
    assert fake.log == []


def test_a_collective_waited_for_is_abandoned_when_the_engine_stops(fake: FakeCupy) -> None:
    comm = _bound(fake, timeout_s=60)
    fake.polls_until_done = -1
    comm.stopped = lambda: RuntimeError("rank 1 is gone")
    start = time.monotonic()
    with pytest.raises(backend.NCCLError, match="engine stopped: rank 1 is gone") as info:
        comm.allreduce(torch.ones(2), torch.ones(2), ReduceOp.SUM)
    assert time.monotonic() - start < 5
    assert not isinstance(info.value, backend.NCCLTimeoutError)
    assert fake.communicators[0].aborted


# ---------------------------------------------------------------------------------------
# Units launched without waiting


@pytest.fixture
def launcher(fake: FakeCupy, monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    """``fake``, with torch's current stream left alone inside units."""
    monkeypatch.setattr(cuda_support, "on_stream", lambda device, ptr: contextlib.nullcontext())
    return fake


def _launch(comm: backend.NCCLCommunicator, tensor: torch.Tensor) -> backend.LaunchedUnit:
    with comm.ordered(DEVICE, [], "allreduce.g") as launched:
        comm.allreduce(tensor, tensor, ReduceOp.SUM)
    return launched


def test_a_unit_is_launched_without_waiting_or_making_the_user_wait(launcher: FakeCupy) -> None:
    comm = _bound(launcher)
    launcher.polls_until_done = 2
    launched = _launch(comm, torch.ones(4))
    # Launched: the collective and its completion event, no poll, no wait of another stream.
    assert launcher.log.names() == ["allReduce", "Event.record"]
    assert [comm.finished(launched) for _ in range(3)] == [False, False, True]


def test_a_launched_unit_past_its_deadline_aborts(launcher: FakeCupy) -> None:
    comm = _bound(launcher, timeout_s=0.05)
    launcher.polls_until_done = -1
    launched = _launch(comm, torch.ones(2))
    assert not comm.finished(launched)
    time.sleep(0.06)
    with pytest.raises(backend.NCCLTimeoutError, match=r"allreduce.g on cuda:0 .* 0.05 s"):
        comm.finished(launched)
    assert launcher.communicators[0].aborted


def test_a_launched_unit_reports_an_asynchronous_error(launcher: FakeCupy) -> None:
    comm = _bound(launcher)
    launcher.polls_until_done = -1
    launched = _launch(comm, torch.ones(2))
    launcher.async_error = 6
    with pytest.raises(backend.NCCLError, match="aborted"):
        comm.finished(launched)
    # The units launched after it can never finish either.
    with pytest.raises(backend.NCCLError, match="cannot finish"):
        comm.finished(launched)


def test_a_launched_unit_is_abandoned_when_the_engine_stops(launcher: FakeCupy) -> None:
    comm = _bound(launcher, timeout_s=60)
    launcher.polls_until_done = -1
    launched = _launch(comm, torch.ones(2))
    comm.stopped = lambda: RuntimeError("rank 1 is gone")
    start = time.monotonic()
    with pytest.raises(backend.NCCLError, match="engine stopped: rank 1 is gone"):
        comm.wait(launched)
    assert time.monotonic() - start < 5
    assert launcher.communicators[0].aborted
