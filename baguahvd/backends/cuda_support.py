"""CuPy and CUDA support for the NCCL backend: importing CuPy, NCCL's type and reduction
tables, the backend's errors, and the stream helpers both the backend and the engine use
(which device and stream a tensor is on, the mark a submission leaves on its stream).

Only this module and :mod:`baguahvd.backends.nccl` import CuPy, and only when the first CUDA
tensor arrives. Every caller reaches these helpers through this module
(``cuda_support.tensor_device(...)``), so that a test that replaces one here (the stream
model, the fake CuPy's tests) replaces it for all of them.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from baguahvd.common.exceptions import HorovodInternalError
from baguahvd.common.ops import ReduceOp
from baguahvd.kernels import cupy_api

logger = logging.getLogger(__name__)

BFLOAT16_MIN_VERSION = 21000
"""NCCL 2.10 is the first to reduce bfloat16."""

AVG_MIN_VERSION = 21000
"""NCCL 2.10 is the first with ``ncclAvg``."""

_NCCL_AVG = 4
"""``ncclAvg`` in ``ncclRedOp_t``, for CuPy builds that do not name it."""

_INSTALL_HINT = (
    "CUDA tensors need CuPy with NCCL: install baguahvd's GPU extra with "
    '`pip install "baguahvd[cuda12]"` next to a CUDA build of torch, or move the tensors to '
    "the CPU."
)

# NCCL's names of the types it reduces, by torch dtype; bfloat16 joins when NCCL allows it.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.int8: "NCCL_INT8", torch.uint8: "NCCL_UINT8",
    torch.int32: "NCCL_INT32", torch.int64: "NCCL_INT64",
    torch.float16: "NCCL_FLOAT16", torch.float32: "NCCL_FLOAT32",
    torch.float64: "NCCL_FLOAT64",
}
_BFLOAT16_NAME = "NCCL_BFLOAT16"

_OP_NAMES: dict[ReduceOp, str] = {
    ReduceOp.SUM: "NCCL_SUM", ReduceOp.PRODUCT: "NCCL_PROD",
    ReduceOp.MIN: "NCCL_MIN", ReduceOp.MAX: "NCCL_MAX",
}

class NCCLError(HorovodInternalError):
    """An NCCL call failed, or the communicator had been aborted by an earlier failure.

    Once a communicator is aborted every later collective of its process set raises this
    error; the job has to be restarted (or, in elastic mode, reset).
    """


class NCCLTimeoutError(NCCLError):
    """A collective did not finish within the communicator's timeout; the communicator was
    aborted so that no rank stays blocked in it. Usually a peer died or skipped the call."""


_NCCL_MISSING = (
    "CuPy is installed but cannot use NCCL: libnccl.so.2 was not found (or this CuPy build "
    "has no NCCL support). Install NCCL with `pip install nvidia-nccl-cu12` (part of "
    "baguahvd[cuda12]) and make sure libnccl.so.2 is on the library path (LD_LIBRARY_PATH)"
)


class NCCLUnavailableError(HorovodInternalError):
    """A CUDA tensor reached the collectives but CuPy with NCCL cannot be imported."""

    def __init__(self, reason: str = "", message: str = _INSTALL_HINT) -> None:
        super().__init__(f"{message}{f' ({reason})' if reason else ''}")


def import_cupy() -> Any:
    """Imports CuPy and its NCCL bindings, deferred to the first CUDA tensor because the
    import is slow and needs a CUDA driver.

    Raises:
        NCCLUnavailableError: CuPy, or its NCCL bindings, cannot be imported.
    """
    try:
        import cupy
    except ImportError as exc:
        raise NCCLUnavailableError(f"CuPy is not installed: {exc}") from exc
    try:
        import cupy.cuda.nccl
    except ImportError as exc:
        raise NCCLUnavailableError(str(exc), _NCCL_MISSING) from exc
    if not getattr(cupy.cuda.nccl, "available", True):
        raise NCCLUnavailableError(message=_NCCL_MISSING)
    return cupy


def dtype_table(nccl: Any) -> dict[torch.dtype, int]:
    """NCCL's type codes, by the torch dtypes it can reduce."""
    table = {dtype: int(getattr(nccl, name)) for dtype, name in _DTYPE_NAMES.items()}
    if hasattr(nccl, _BFLOAT16_NAME) and int(nccl.get_version()) >= BFLOAT16_MIN_VERSION:
        table[torch.bfloat16] = int(getattr(nccl, _BFLOAT16_NAME))
    return table


def op_table(nccl: Any) -> dict[ReduceOp, int]:
    """NCCL's reduction codes, by :class:`ReduceOp`. AVERAGE is ``ncclAvg`` from NCCL 2.10 on
    (before, the engine builds it on SUM); ADASUM is always built by the engine."""
    table = {op: int(getattr(nccl, name)) for op, name in _OP_NAMES.items()}
    if int(nccl.get_version()) >= AVG_MIN_VERSION:
        table[ReduceOp.AVERAGE] = int(getattr(nccl, "NCCL_AVG", _NCCL_AVG))
    return table


def is_cuda(tensor: torch.Tensor) -> bool:
    # The attribute, not tensor.device: that builds an object, on every submission.
    return bool(tensor.is_cuda)


def tensor_device(tensor: torch.Tensor) -> torch.device:
    """The CUDA device of ``tensor``, with its index filled in."""
    if not is_cuda(tensor):
        raise ValueError(f"the NCCL backend needs CUDA tensors, got one on {tensor.device}.")
    index = tensor.device.index
    return torch.device("cuda", torch.cuda.current_device() if index is None else index)


def current_stream_ptr(device: torch.device) -> int:
    """The handle of this thread's current torch stream on ``device``."""
    return int(torch.cuda.current_stream(device).cuda_stream)


@contextmanager
def on_stream(device: torch.device, ptr: int) -> Iterator[None]:
    """Makes the stream of handle ``ptr`` torch's current stream on ``device`` (this thread)."""
    with torch.cuda.stream(torch.cuda.ExternalStream(ptr, device=device)):
        yield


def record_stream(tensor: torch.Tensor, device: torch.device, ptr: int) -> None:
    """Tells torch's caching allocator that the stream of handle ``ptr`` uses ``tensor``."""
    tensor.record_stream(torch.cuda.ExternalStream(ptr, device=device))


def set_torch_device(device: torch.device) -> None:
    """torch's current device for this thread."""
    torch.cuda.set_device(device)


def thread_cuda_device() -> torch.device | None:
    """This thread's current CUDA device in torch, None without CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def stream_capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a CUDA graph; False without
    CUDA."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_CAPTURE_MODE_RELAXED = 2
"""``cudaStreamCaptureModeRelaxed`` (``CU_STREAM_CAPTURE_MODE_RELAXED``)."""

_CUDA_SUCCESS = 0


def _cuda_driver() -> Any:
    """The CUDA driver library; None without one."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def relax_capture_mode() -> bool:
    """Puts the calling thread in CUDA's relaxed stream-capture mode, so that its CUDA calls
    (an event query, an allocation) do not break a graph another thread is capturing.

    torch captures in the global mode by default, in which such a call from any thread
    whose own mode is global invalidates the capture. baguahvd's background threads that
    talk to CUDA call this when they start and, where CUDA may not have been initialized
    then, again before their first CUDA call. It goes through the driver's
    ``cuThreadExchangeStreamCaptureMode`` (CuPy does not expose it; the runtime's
    ``cudaThreadExchangeStreamCaptureMode`` forwards to it): a driver call needs no CUDA
    context, so it makes none (on GPU 0, for a thread that has not selected its device).

    Returns:
        Whether the thread is now in the relaxed mode: False without a CUDA driver (nothing
        to do) and while the process has not initialized CUDA yet (call again later).
    """
    driver = _cuda_driver()
    if driver is None:
        return False
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    status = driver.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
    if status != _CUDA_SUCCESS:
        logger.debug("cuThreadExchangeStreamCaptureMode returned %s", status)
        return False
    return True


def set_cupy_device(device: torch.device) -> None:
    """CuPy's current device for this thread."""
    import_cupy().cuda.Device(device.index).use()


def new_stream(device: torch.device) -> int:
    """The handle of a high-priority torch stream on ``device`` for a background thread's
    communication. torch takes it from its pool, whose streams live as long as the process."""
    return int(torch.cuda.Stream(device=device, priority=-1).cuda_stream)


def record_event(device: torch.device, ptr: int) -> Any:
    """A CuPy event recorded on the stream of handle ``ptr`` on ``device``; the calling
    thread keeps whatever CuPy device it had."""
    cupy = import_cupy()
    with cupy.cuda.Device(device.index):
        event = cupy.cuda.Event(disable_timing=True)
        event.record(external_stream(cupy, ptr, device.index))
    return event


def current_stream_done(device: torch.device) -> Any:
    """An event recorded now on this thread's current stream of ``device``, for the host to
    ``synchronize()`` on later: CuPy's where CuPy is installed, else torch's (a job of one
    rank reduces CUDA tensors without CuPy)."""
    try:
        return record_event(device, current_stream_ptr(device))
    except NCCLUnavailableError:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event


def wait_event(device: torch.device, ptr: int, event: Any) -> None:
    """Makes the stream of handle ``ptr`` on ``device`` wait for ``event`` (from
    :func:`record_event` or a :class:`StreamMark`); the host does not wait."""
    cupy = import_cupy()
    with cupy.cuda.Device(device.index):
        external_stream(cupy, ptr).wait_event(event)


class StreamMark(NamedTuple):
    """Where a submitted collective stands in its submitter's stream: the device, the
    submitting thread's current stream (which consumes the results) and an event recorded on
    it when submitted (after the work producing the inputs)."""

    device: torch.device
    consumer: int
    ready: Any


def mark_submission(tensors: Sequence[torch.Tensor]) -> StreamMark | None:
    """The :class:`StreamMark` of a submission of ``tensors``; None unless they are CUDA
    tensors. Called on the submitting thread."""
    if not tensors or not is_cuda(tensors[0]):
        return None
    device = tensor_device(tensors[0])
    consumer = current_stream_ptr(device)
    return StreamMark(device, consumer, record_event(device, consumer))


def external_stream(cupy: Any, ptr: int, device_index: int = -1) -> Any:
    """CuPy's view of the CUDA stream of handle ``ptr`` (a stream CuPy did not create), in
    the form the installed CuPy offers (:func:`baguahvd.kernels.cupy_api.external_stream`)."""
    return cupy_api.external_stream(cupy, ptr, device_index)


def device_ptr(tensor: torch.Tensor, offset: int = 0) -> int:
    """The device address of element ``offset`` of a contiguous tensor."""
    assert tensor.is_contiguous(), "the engine hands NCCL contiguous buffers only"
    return int(tensor.data_ptr()) + offset * tensor.element_size()


def block_offsets(counts: Sequence[int]) -> list[int]:
    """Where each of consecutive blocks of ``counts`` elements starts."""
    offsets, total = [], 0
    for count in counts:
        offsets.append(total)
        total += count
    return offsets
