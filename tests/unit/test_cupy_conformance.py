"""baguahvd's CuPy and NCCL calls, and the fakes that stand for CuPy, against the real CuPy.

CuPy (cupy-cuda12x / cupy-cuda13x) and NCCL (nvidia-nccl-cu12 / -cu13) install and import on
a machine without a GPU, and every function refuses wrong arguments before it needs a device.
So each check here drives the real function up to that boundary: a call passes when the real
function got past its argument checks (it then fails with a CUDA or NCCL error, or works),
and fails when it raised one of :data:`~tests.fakes.cupy_spec.ARGUMENT_ERRORS`.

- The signatures recorded in :mod:`tests.fakes.cupy_spec` are the installed CuPy's.
- The fakes refuse exactly what the real functions refuse, call by call.
- baguahvd's own compatibility functions work against the real CuPy (13 or 14, whichever is
  installed) up to the device.
- Every NCCL call baguahvd makes, with the arguments it passes (recorded through the fake
  while the backend runs each collective), passes the real bindings' argument checks.

CI installs CuPy 14 and runs this module; it runs it again against CuPy 13 (see .ci/run).
The whole module skips where CuPy is not installed.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from baguahvd.backends import cuda_support, nccl_setup
from baguahvd.backends import nccl as backend
from baguahvd.common.ops import ReduceOp
from baguahvd.kernels import cupy_api
from baguahvd.kernels.sources import NVRTC_OPTIONS, nvrtc_source
from tests.fakes import fake_mpi
from tests.fakes.cupy_spec import ARGUMENT_ERRORS, SIGNATURES, signature
from tests.fakes.fake_cupy import NCCL_OPS, NCCL_TYPES, FakeCupy

cupy = pytest.importorskip("cupy")
real_nccl = pytest.importorskip("cupy.cuda.nccl")

API = int(cupy.__version__.split(".")[0])
if API not in (13, 14):
    pytest.skip(f"CuPy {cupy.__version__} is neither 13 nor 14", allow_module_level=True)

DEVICE = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _quiet_destructors() -> Iterator[None]:
    # Real CuPy objects whose constructor failed for want of a device complain in __del__.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnraisableExceptionWarning)
        yield


# ---------------------------------------------------------------------------------------
# The recorded signatures are the installed CuPy's


def _real(name: str) -> Any:
    """The installed CuPy's object of a :mod:`tests.fakes.cupy_spec` name."""
    root, *path = name.split(".")
    target: Any = {"nccl": real_nccl, "cuda": cupy.cuda}[root]
    for part in path:
        target = getattr(target, part)
    return target


def _signature_line(obj: Any, name: str) -> str:
    """The signature line CuPy states for ``obj``: a Cython function's first docstring line,
    else the Python signature under the object's name."""
    first = (inspect.getdoc(obj) or "").splitlines()[0] if inspect.getdoc(obj) else ""
    short = name.rsplit(".", 1)[-1]
    if "(" in first and first.split("(")[0].split(".")[-1] in (short, obj.__name__):
        return first
    parameters = str(inspect.signature(obj)).replace("(self, ", "(").replace("(self)", "()")
    return f"{short}{parameters}"


@pytest.mark.parametrize("name", sorted(SIGNATURES[14]))
def test_recorded_signatures_are_the_installed_cupys(name: str) -> None:
    recorded = signature(API, name)
    root, *path = name.split(".")
    parent = _real(".".join([root, *path[:-1]])) if path[:-1] else (
        {"nccl": real_nccl, "cuda": cupy.cuda}[root]
    )
    if not recorded:
        assert not hasattr(parent, path[-1]), f"CuPy {API} has {name} now"
        return
    line = _signature_line(_real(name), name)
    if "(self" in recorded:
        # A method: compare what follows the class name.
        assert line.split("(", 1)[1] == recorded.split("(", 1)[1], (line, recorded)
    else:
        assert line.split("(", 1)[1] == recorded.split("(", 1)[1], (line, recorded)


# ---------------------------------------------------------------------------------------
# The fakes refuse what the real functions refuse


class _Protocol:
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def __cuda_stream__(self) -> Any:
        return self.answer


def _unique_id() -> Any:
    # Made by the real NCCL: what the backend passes back to NcclCommunicator on this CuPy.
    return real_nccl.get_unique_id()


def _probes() -> list[tuple[str, Callable[[Any], Any]]]:
    """(label, call on a ``cupy`` module): calls baguahvd makes, and wrong ones."""
    good_id = cupy_api.unique_id_bytes(_unique_id())
    native_id = good_id if API == 14 else cupy_api.signed_chars(good_id)
    other_id = cupy_api.signed_chars(good_id) if API == 14 else good_id

    def comm(module: Any) -> Any:
        cls = module.cuda.nccl.NcclCommunicator
        if module is cupy:
            # A communicator object without ncclCommInitRank: its methods check their
            # arguments, then NCCL refuses the null communicator.
            return cls.__new__(cls)
        return cls(1, native_id, 0)

    return [
        ("get_unique_id", lambda m: m.cuda.nccl.get_unique_id()),
        ("get_version", lambda m: m.cuda.nccl.get_version()),
        ("NcclCommunicator(native id)", lambda m: m.cuda.nccl.NcclCommunicator(1, native_id, 0)),
        ("NcclCommunicator(other id)", lambda m: m.cuda.nccl.NcclCommunicator(1, other_id, 0)),
        ("NcclCommunicator(bytearray)",
         lambda m: m.cuda.nccl.NcclCommunicator(1, bytearray(good_id), 0)),
        ("NcclCommunicator(list)", lambda m: m.cuda.nccl.NcclCommunicator(1, list(good_id), 0)),
        ("NcclCommunicator(float ndev)",
         lambda m: m.cuda.nccl.NcclCommunicator(1.0, native_id, 0)),
        ("NcclCommunicator(short id)",
         lambda m: m.cuda.nccl.NcclCommunicator(1, native_id[:10], 0)),
        ("allReduce", lambda m: comm(m).allReduce(0, 0, 1, 7, 0, 0)),
        ("allReduce(bool)", lambda m: comm(m).allReduce(True, 0, 1, 7, 0, 0)),
        ("allReduce(keywords)", lambda m: comm(m).allReduce(
            sendbuf=0, recvbuf=0, count=1, datatype=7, op=0, stream=0)),
        ("allReduce(float pointer)", lambda m: comm(m).allReduce(0.5, 0, 1, 7, 0, 0)),
        ("allReduce(numpy pointer)", lambda m: comm(m).allReduce(np.int64(0), 0, 1, 7, 0, 0)),
        ("allReduce(negative count)", lambda m: comm(m).allReduce(0, 0, -1, 7, 0, 0)),
        ("allReduce(stream None)", lambda m: comm(m).allReduce(0, 0, 1, 7, 0, None)),
        ("allReduce(stream object)",
         lambda m: comm(m).allReduce(0, 0, 1, 7, 0, _Protocol((0, 5)))),
        ("allReduce(5 arguments)", lambda m: comm(m).allReduce(0, 0, 1, 7, 0)),
        ("reduce", lambda m: comm(m).reduce(0, 0, 1, 7, 0, 0, 0)),
        ("broadcast", lambda m: comm(m).broadcast(0, 0, 1, 7, 0, 0)),
        ("bcast", lambda m: comm(m).bcast(0, 1, 7, 0, 0)),
        ("reduceScatter", lambda m: comm(m).reduceScatter(0, 0, 1, 7, 0, 0)),
        ("allGather", lambda m: comm(m).allGather(0, 0, 1, 7, 0)),
        ("send", lambda m: comm(m).send(0, 1, 7, 0, 0)),
        ("recv", lambda m: comm(m).recv(0, 1, 7, 0, 0)),
        ("recv(size_t -1)", lambda m: comm(m).recv(0, -1, 7, 0, 0)),
        ("abort", lambda m: comm(m).abort()),
        ("destroy", lambda m: comm(m).destroy()),
        ("from_external(int)", lambda m: m.cuda.Stream.from_external(1234)),
        ("from_external(int, device)", lambda m: m.cuda.Stream.from_external(1234, 0)),
        ("from_external(protocol)", lambda m: m.cuda.Stream.from_external(_Protocol((0, 9)))),
        ("from_external(bad protocol)", lambda m: m.cuda.Stream.from_external(_Protocol(9))),
        ("ExternalStream", lambda m: m.cuda.ExternalStream(1234, 0)),
        ("Stream()", lambda m: m.cuda.Stream(non_blocking=True)),
        ("Stream(ptr=)", lambda m: m.cuda.Stream(non_blocking=True, ptr=5)),
        ("Event()", lambda m: m.cuda.Event(disable_timing=True)),
        ("Event(unknown keyword)", lambda m: m.cuda.Event(timing=False)),
        ("Device(0)", lambda m: m.cuda.Device(0)),
        ("Device('x')", lambda m: m.cuda.Device("x")),
        ("alloc(1)", lambda m: m.cuda.alloc(1)),
        ("alloc(-1)", lambda m: m.cuda.alloc(-1)),
        ("alloc('a')", lambda m: m.cuda.alloc("a")),
    ]


def _outcome(call: Callable[[Any], Any], module: Any) -> str:
    """``"passes"`` when ``call`` got past the argument checks, else the refusal's class."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            call(module)
    except ARGUMENT_ERRORS + (AttributeError,) as refused:
        return type(refused).__name__
    except Exception:  # noqa: BLE001 - a CUDA or NCCL error: the call reached the device
        return "passes"
    return "passes"


@pytest.mark.parametrize("label", [label for label, _ in _probes()])
def test_the_fake_refuses_what_the_real_cupy_refuses(label: str) -> None:
    call = dict(_probes())[label]
    assert _outcome(call, FakeCupy(api=API).cupy) == _outcome(call, cupy), label


def test_the_probes_cover_both_answers() -> None:
    # A probe table in which everything passes (or nothing does) would prove nothing.
    outcomes = {label: _outcome(call, cupy) for label, call in _probes()}
    assert outcomes["allReduce"] == "passes"
    assert outcomes["NcclCommunicator(native id)"] == "passes"
    assert outcomes["NcclCommunicator(other id)"] == "TypeError"
    assert outcomes["allReduce(numpy pointer)"] == "TypeError"
    assert outcomes["alloc(-1)"] == "OverflowError"


# ---------------------------------------------------------------------------------------
# baguahvd's own CuPy calls, on the real CuPy up to the device


def test_external_stream_wraps_a_handle_without_a_deprecation_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        stream = cupy_api.external_stream(cupy, 0x1234, 0)
    assert stream.ptr == 0x1234
    assert isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream))


def test_the_unique_id_of_real_nccl_reaches_the_constructors_device_boundary() -> None:
    raw = cupy_api.unique_id_bytes(real_nccl.get_unique_id())
    assert isinstance(raw, bytes) and len(raw) == cupy_api.UNIQUE_ID_BYTES
    # Past the argument check, ncclCommInitRank needs a GPU: NCCL's own error, no TypeError.
    with pytest.raises(real_nccl.NcclError):
        cupy_api.new_communicator(real_nccl, 1, raw, 0)


def test_the_type_tables_match_real_nccl_and_the_fake() -> None:
    assert cuda_support.import_cupy() is cupy
    dtypes = cuda_support.dtype_table(real_nccl)
    ops = cuda_support.op_table(real_nccl)
    assert {name: getattr(real_nccl, name) for name in NCCL_TYPES} == NCCL_TYPES
    assert {name: getattr(real_nccl, name) for name in NCCL_OPS} == NCCL_OPS
    assert dtypes[torch.bfloat16] == NCCL_TYPES["NCCL_BFLOAT16"]
    assert ops[ReduceOp.AVERAGE] == NCCL_OPS["NCCL_AVG"]


def test_the_kernel_module_is_built_with_the_arguments_cupy_takes() -> None:
    # The RawModule constructor checks its arguments (a str and a tuple of options); its
    # compile needs a device.
    module = cupy.RawModule(code=nvrtc_source(), options=NVRTC_OPTIONS)
    assert module is not None


def _run_every_collective(fake: FakeCupy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every collective of the NCCL backend on rank 1 of 3, run through ``fake`` on CPU
    tensors that stand for CUDA ones, so that the fake's call log holds the calls with
    baguahvd's arguments (uneven blocks and peers included)."""
    fake.install(monkeypatch)
    monkeypatch.setattr(cuda_support, "tensor_device", lambda tensor: DEVICE)
    monkeypatch.setattr(cuda_support, "current_stream_ptr", lambda device: 0x77)
    monkeypatch.setattr(cuda_support, "set_torch_device", lambda device: None)
    members = fake_mpi.members(3)
    comm = backend.NCCLCommunicator(members[1], timeout_s=30)
    # The first rank's broadcast of the id, as if it had created its communicator first.
    members[0].Ibcast(bytearray(cupy_api.unique_id_bytes(_unique_id())), root=0)
    x = torch.ones(6)
    comm.allreduce(x, x, ReduceOp.SUM)
    comm.allreduce(torch.ones(6, dtype=torch.float16), torch.empty(6, dtype=torch.float16),
                   ReduceOp.AVERAGE)
    comm.allgather(torch.ones(2), torch.empty(6), [2, 2, 2])
    comm.allgather(torch.ones(2), torch.empty(5), [1, 2, 2])
    comm.broadcast(torch.ones(4, dtype=torch.int16), 0)
    comm.alltoall(torch.ones(6), [2, 2, 2], torch.empty(6), [2, 2, 2])
    comm.reduce_scatter(torch.ones(6), torch.empty(2), [2, 2, 2], ReduceOp.MAX)
    comm.reduce_scatter(torch.ones(5), torch.empty(2), [1, 2, 2], ReduceOp.SUM)
    comm.sendrecv(torch.ones(3), torch.empty(3), 0)


_NCCL_METHODS = (
    "allReduce", "reduce", "broadcast", "bcast", "reduceScatter", "allGather", "send", "recv",
)


def test_every_nccl_call_of_the_backend_passes_the_real_argument_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCupy(api=API)
    fake.polls_until_done = 0
    _run_every_collective(fake, monkeypatch)
    calls = [entry for entry in fake.log if entry[0] in _NCCL_METHODS]
    assert {entry[0] for entry in calls} >= {
        "allReduce", "allGather", "broadcast", "send", "recv", "reduceScatter", "reduce",
    }
    real = real_nccl.NcclCommunicator.__new__(real_nccl.NcclCommunicator)
    for name, _rank, *args in calls:
        # NCCL refuses the null communicator: the arguments got through.
        with pytest.raises(real_nccl.NcclError):
            getattr(real, name)(*args)


def test_the_unique_id_travels_as_bytes_to_the_real_constructor() -> None:
    # Three members exchange a real unique id through the fake MPI (as nccl_setup does over
    # mpi4py), then each reaches the real constructor's device boundary with it.
    members = fake_mpi.members(3)
    watch = nccl_setup._Watch("test", 5.0, None)
    received = [nccl_setup.exchange_unique_id(member, rank, real_nccl, watch)
                for rank, member in enumerate(members)]
    assert len(set(received)) == 1 and isinstance(received[0], bytes)
    for rank, raw in enumerate(received):
        with pytest.raises(real_nccl.NcclError):
            cupy_api.new_communicator(real_nccl, 3, raw, rank)
