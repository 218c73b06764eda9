"""Horovod's collectives for torch tensors, in their four variants.

``allreduce`` / ``allreduce_`` / ``allreduce_async`` / ``allreduce_async_`` (and the same for
the other collectives) all submit one request to the engine. The async variants return an
integer handle for :func:`poll` and :func:`synchronize`; the blocking variants wait, and
the out-of-place ones are differentiable with Horovod's gradients.

A call that fails its local checks (a bad tensor, op or argument) raises at once, and its
collective still takes its place in negotiation (:func:`_takes_its_place`): the other ranks'
matching call fails naming this rank and its error, and no rank's later unnamed collectives
pair with the wrong ones.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import torch

from baguahvd.backends import memory
from baguahvd.common import capabilities
from baguahvd.common.exceptions import (
    DuplicateNameError,
    HorovodInternalError,
    ProcessSetError,
)
from baguahvd.common.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    to_reduce_op,
)
from baguahvd.engine.engine import GLOBAL_PROCESS_SET_ID, Engine
from baguahvd.engine.messages import OpType
from baguahvd.engine.requests import Handle
from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.compression import Compression

__all__ = [
    "Adasum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "Average",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "Max",
    "Min",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "ProcessSet",
    "Product",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "Sum",
    "synchronize",
]

logger = logging.getLogger("baguahvd.torch")

_P = ParamSpec("_P")
_R = TypeVar("_R")

_ALLREDUCE = OpType.ALLREDUCE  # a member looked up on its class costs as much as a dict lookup
_STRIDED = torch.strided

_REDUCIBLE = frozenset(
    {torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64}
)
_MOVABLE = _REDUCIBLE | {torch.uint8, torch.int8, torch.int16}


# ---------------------------------------------------------------------------------------
# Basics and process sets, bound here as in Horovod's file (``from horovod.torch.mpi_ops
# import size, rank`` works, and ``_basics`` is the object behind them)

_basics = runtime
init = _basics.init
shutdown = _basics.shutdown
is_initialized = _basics.is_initialized
size = _basics.size
local_size = _basics.local_size
cross_size = _basics.cross_size
rank = _basics.rank
local_rank = _basics.local_rank
cross_rank = _basics.cross_rank
is_homogeneous = _basics.is_homogeneous
mpi_threads_supported = _basics.mpi_threads_supported
mpi_enabled = _basics.mpi_enabled
gloo_enabled = _basics.gloo_enabled
mpi_built = capabilities.mpi_built
gloo_built = capabilities.gloo_built
nccl_built = capabilities.nccl_built
ddl_built = capabilities.ddl_built
ccl_built = capabilities.ccl_built
cuda_built = capabilities.cuda_built
rocm_built = capabilities.rocm_built
add_process_set = _basics.add_process_set
remove_process_set = _basics.remove_process_set


# ---------------------------------------------------------------------------------------
# Validation shared by every collective


class _ArgumentError(HorovodInternalError):
    """A bad argument that Horovod reports as ``HorovodInternalError``. The subclass tells
    it apart from the engine's errors of that class: it is a local-check failure."""


# Set on an error once its collective has taken its place: a blocking variant that calls
# an async one sees the same error and must not place the collective twice.
_PLACED = "_baguahvd_placed"


def _takes_its_place(
    op: OpType, label: str, suffixes: tuple[str, ...] = ("",)
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Makes a public entry point's collective take its place in negotiation even when the
    call fails its local checks.

    The call raises its error as before. When the error is a local-check failure, i.e. any
    exception but the engine's own (``HorovodInternalError`` other than
    :class:`_ArgumentError`, ``DuplicateNameError``), this rank also submits a placeholder
    for the collective (:meth:`~baguahvd.engine.engine.Engine.take_place`) under the call's
    ``name`` (or the next unnamed key) and ``process_set``. The success path only calls
    through (one frame, about 0.25 us per call measured on one rank).

    Args:
        op: the collective the entry point submits.
        label: Horovod's op name in its tensor names (``allreduce``, ``grouped_allgather``).
        suffixes: one placeholder per suffix, appended to a given name (an entry point that
            submits several collectives, like the sparse allreduce's two allgathers).
    """

    def decorate(function: Callable[_P, _R]) -> Callable[_P, _R]:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return function(*args, **kwargs)
            except Exception as exc:
                try:
                    arguments: Mapping[str, Any] = signature.bind_partial(*args, **kwargs).arguments
                except TypeError:  # the call's own arguments do not fit its signature
                    arguments = kwargs
                _place(
                    exc, op, label, suffixes, arguments.get("name"),
                    arguments.get("process_set", global_process_set),
                )
                raise

        return wrapper

    return decorate


def _place(
    exc: Exception,
    op: OpType,
    label: str,
    suffixes: tuple[str, ...],
    name: Any,
    process_set: Any,
) -> None:
    """The failure path of :func:`_takes_its_place`, given the call's ``name`` and
    ``process_set`` arguments (also called by the entry points that catch their own errors
    rather than be wrapped: see :func:`allreduce_async_`)."""
    if getattr(exc, _PLACED, False):
        return
    if isinstance(exc, (HorovodInternalError, DuplicateNameError)) and not isinstance(
        exc, _ArgumentError
    ):
        return
    try:
        setattr(exc, _PLACED, True)
    except AttributeError:  # an exception type without a __dict__: placed at most twice
        pass
    engine = runtime.engine
    if engine is None:
        return
    ident = getattr(process_set, "process_set_id", None)
    if not isinstance(ident, int):
        return
    kind = next(c.__name__ for c in type(exc).__mro__ if not c.__name__.startswith("_"))
    reason = f"{kind}: {exc}"
    for suffix in suffixes:
        try:
            engine.take_place(
                op, label, ident, None if name is None else f"{name}{suffix}", reason
            )
        except (HorovodInternalError, ValueError) as error:
            # The engine stopped, or the name is in flight: nothing to hold a place for.
            logger.debug("%s: no placeholder submitted: %s", label, error)


def _check_tensor(tensor: Any, allowed: frozenset[torch.dtype], what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.layout is not torch.strided:
        raise ValueError(
            f"{what} expects a dense tensor, got a sparse one ({tensor.layout}): reduce "
            "sparse tensors with hvd.sparse_allreduce_async, densify with .to_dense(), or "
            "pass sparse_as_dense=True to DistributedOptimizer."
        )
    if tensor.dtype not in allowed:
        raise ValueError(f"Tensor type {tensor.type()} is not supported.")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    # is_cpu / is_cuda first: reading tensor.device builds an object, on every request.
    if tensor.is_cpu:
        return tensor
    if not tensor.is_cuda:
        raise ValueError(f"{what}: tensors on {tensor.device} are not supported.")
    # Probing imports CuPy, so only the first CUDA tensor pays for it (the answer is cached).
    if not capabilities.nccl_built():
        raise _ArgumentError(
            f"{what}: CUDA tensors need baguahvd's GPU backend (CuPy with NCCL), which is not "
            "available in this installation; install it with `pip install baguahvd[cuda12]`, "
            "or move the tensor to the CPU."
        )
    return tensor


def _check_group(tensors: Any, allowed: frozenset[torch.dtype], what: str) -> list[torch.Tensor]:
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{what} expects a non-empty list of tensors.")
    first = tensors[0]
    if isinstance(first, torch.Tensor) and first.is_cpu and first.dtype in allowed:
        # The common case in one pass: dense contiguous CPU tensors of the first one's
        # dtype. Anything else goes through the per-tensor checks, which name the problem.
        dtype, strided = first.dtype, torch.strided
        if all(
            isinstance(t, torch.Tensor) and t.dtype is dtype and t.is_cpu
            and t.layout is strided and t.is_contiguous()
            for t in tensors
        ):
            return tensors
    checked = [_check_tensor(t, allowed, what) for t in tensors]
    first = checked[0]
    # is_cpu and dtype first: reading tensor.device builds an object per tensor.
    if first.is_cpu:
        if not all(t.is_cpu for t in checked):
            raise _ArgumentError("Tensors in list must be on same device.")
    elif len({t.device for t in checked}) > 1:
        raise _ArgumentError("Tensors in list must be on same device.")
    dtype = first.dtype
    if not all(t.dtype is dtype for t in checked):
        raise ValueError(
            f"{what} expects tensors of one dtype, got {sorted({str(t.dtype) for t in checked})}."
        )
    return checked


def _process_set_id(process_set: ProcessSet, title: str) -> int:
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{title}: process_set must be a ProcessSet, got {process_set!r}.")
    if process_set.process_set_id is None:
        raise ProcessSetError(
            f"{title}: Process set provided does not exist, or has not been registered."
        )
    return process_set.process_set_id


def _resolve_op(average: bool | None, op: int | None, default: ReduceOp = Average) -> ReduceOp:
    if average is None:
        if op is None:
            return default
        if type(op) is ReduceOp:
            return op
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in v1.0",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    return default if op is None else to_reduce_op(op)


def _check_adasum(engine: Engine, process_set_id: int, tensors: Sequence[torch.Tensor]) -> None:
    if process_set_id != GLOBAL_PROCESS_SET_ID:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    size = engine.size
    if size & (size - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    for tensor in tensors:
        if not tensor.is_floating_point():
            raise ValueError(f"Adasum needs floating-point tensors, got {tensor.dtype}.")


def _no_grad_flows(tensor: Any) -> bool:
    """Whether no gradient can flow through ``tensor`` here (differentiable collectives
    then skip their autograd node). A non-tensor goes on to the checks that name it."""
    return not (isinstance(tensor, torch.Tensor) and tensor.requires_grad) or (
        not torch.is_grad_enabled()
    )


def _register(handle: Handle, finish: Callable[[Handle], Any]) -> int:
    return runtime.handles.add(handle, finish)


def _first(handle: Handle) -> Any:
    assert handle.result is not None
    return handle.result[0]


def _as_tuple(handle: Handle) -> Any:
    assert handle.result is not None
    return tuple(handle.result)


# ---------------------------------------------------------------------------------------
# Handles


def poll(handle: int) -> bool:
    """Returns True once the collective behind ``handle`` has finished; never blocks.

    Raises:
        ValueError: ``handle`` was never issued or has already been synchronized.
    """
    found = runtime.handles.get(handle)
    if found is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return found.done()


def synchronize(handle: int) -> Any:
    """Waits for the collective behind ``handle`` and returns its output.

    Returns ``None`` for an unknown or already-consumed handle.

    Raises:
        HorovodInternalError: the collective failed on this rank or across ranks.
    """
    engine_handle = runtime.handles.pop(handle)
    if engine_handle is None:
        return None
    engine_handle.wait()
    assert engine_handle.finish is not None
    return engine_handle.finish(engine_handle)


def _wait(handle: int) -> Handle:
    engine_handle = runtime.handles.pop(handle)
    assert engine_handle is not None
    engine_handle.wait()
    return engine_handle


# ---------------------------------------------------------------------------------------
# Allreduce


def _allreduce_submit(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    label: str,
    average: bool | None,
    name: str | None,
    op: int | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    blocking: bool = False,
) -> Handle:
    # Every allreduce passes here, one per gradient in a hand-written loop: the common
    # cases first (no op given, a registered ProcessSet), the calls that name errors after.
    reduce_op = Average if op is None and average is None else _resolve_op(average, op)
    engine = runtime.engine or runtime.require_engine()  # which raises without one
    ident = process_set.process_set_id if type(process_set) is ProcessSet else None
    if ident is None:
        ident = _process_set_id(process_set, "Allreduce")  # which raises
    if reduce_op is Adasum:
        _check_adasum(engine, ident, tensors)
    return engine.submit(
        _ALLREDUCE, label, ident, tensors, outputs, name, reduce_op, prescale_factor,
        postscale_factor, blocking=blocking,
    )


def _allreduce_start(
    tensors: Any,
    average: bool | None,
    name: str | None,
    op: int | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    *,
    grouped: bool,
    in_place: bool,
    blocking: bool,
) -> Handle:
    """Checks and submits an allreduce of one tensor (``grouped`` False: ``tensors`` is that
    tensor) or of a list as one unit; ``blocking``: the caller waits for it at once."""
    if not grouped:
        return _allreduce_one(
            tensors, in_place, average, name, op, prescale_factor, postscale_factor,
            process_set, blocking,
        )
    label = "grouped_allreduce"
    checked = _check_group(tensors, _REDUCIBLE, label)
    # Contiguous already, so preserving their format gives contiguous outputs.
    outputs = checked if in_place else [memory.empty_like(t) for t in checked]
    return _allreduce_submit(
        checked, outputs, label, average, name, op, prescale_factor, postscale_factor,
        process_set, blocking,
    )


def _allreduce_one(
    tensor: Any,
    in_place: bool,
    average: bool | None,
    name: str | None,
    op: int | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    blocking: bool = False,
) -> Handle:
    """:func:`_allreduce_start` of one tensor, in as few steps as it takes: a hand-written
    gradient loop calls it per tensor, and each step of Python is a share of what the
    training thread pays (about 3.5 us a call in all on this machine)."""
    # The common case in one test: a dense contiguous CPU tensor of a reducible dtype.
    # Anything else goes through the checks that name the problem.
    if not (
        isinstance(tensor, torch.Tensor) and tensor.is_cpu and tensor.dtype in _REDUCIBLE
        and tensor.layout is _STRIDED and tensor.is_contiguous()
    ):
        tensor = _check_tensor(tensor, _REDUCIBLE, "allreduce")
    inputs = [tensor]
    return _allreduce_submit(
        inputs, inputs if in_place else [memory.empty_like(tensor)], "allreduce", average,
        name, op, prescale_factor, postscale_factor, process_set, blocking,
    )


def bucket_allreduce_async_(
    buffer: torch.Tensor,
    name: str,
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> Handle:
    """Starts an in-place allreduce of one flat gradient bucket, which the engine runs
    alone rather than copying it into a fusion buffer. Not part of Horovod's API: the
    buckets of DistributedOptimizer's default path, which have already checked the
    buffer (flat, contiguous, floating point); returns the engine's handle itself."""
    engine = runtime.require_engine()
    return engine.submit(
        OpType.ALLREDUCE,
        "allreduce",
        _process_set_id(process_set, "Allreduce"),
        (buffer,),
        (buffer,),
        name=name,
        reduce_op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        fuse=False,
    )


def _waited(handle: Handle) -> list[torch.Tensor]:
    result = handle.wait()
    assert result is not None
    return result


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an out-of-place allreduce; see :func:`allreduce`. Returns a handle."""
    # Catches its own errors rather than being wrapped by _takes_its_place: one frame
    # less on the path of every gradient a hand-written loop submits.
    try:
        handle = _allreduce_one(
            tensor, False, average, name, op, prescale_factor, postscale_factor, process_set
        )
    except Exception as exc:
        _place(exc, _ALLREDUCE, "allreduce", ("",), name, process_set)
        raise
    return runtime.handles.add(handle, _first)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an in-place allreduce of ``tensor``; see :func:`allreduce`. Returns a handle."""
    try:  # as in allreduce_async
        handle = _allreduce_one(
            tensor, True, average, name, op, prescale_factor, postscale_factor, process_set
        )
    except Exception as exc:
        _place(exc, _ALLREDUCE, "allreduce", ("",), name, process_set)
        raise
    return runtime.handles.add(handle, _first)


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        prescale_factor: float,
        postscale_factor: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.op = op
        ctx.factors = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        handle = _allreduce_start(
            tensor, None, name, op, prescale_factor, postscale_factor, process_set,
            grouped=False, in_place=False, blocking=True,
        )
        return _waited(handle)[0]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = allreduce(
            grad_output.contiguous(),
            op=ctx.op,
            prescale_factor=ctx.factors[0],
            postscale_factor=ctx.factors[1],
            process_set=ctx.process_set,
        )
        return grad, None, None, None, None, None


@_takes_its_place(OpType.ALLREDUCE, "allreduce")
def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduces ``tensor`` over the ranks of ``process_set`` and returns the result.

    ``result = postscale_factor * REDUCE(prescale_factor * tensor_r)`` over the members r.
    The input is not modified. Differentiable: the gradient is the allreduce of the incoming
    gradient with the same op and factors.

    Args:
        tensor: a contiguous int32, int64, float16, bfloat16, float32 or float64 tensor.
        average: deprecated; True means ``op=Average``, False ``op=Sum``.
        name: key that matches this request across ranks; ranks may submit named requests
            in any order. Unnamed requests are matched by their order.
        compression: compresses the tensor before sending (``Compression.fp16``...).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor: multiplies each rank's tensor before the reduction.
        postscale_factor: multiplies the reduced tensor.
        process_set: the ranks taking part (default: all).

    Raises:
        HorovodInternalError: the ranks disagree on shape, dtype, op, factors or device
            (raised on every rank involved), or the job has shut down.
        ValueError: bad arguments, a name already in flight, or a foreign process set.
    """
    reduce_op = _resolve_op(average, op)
    compressed, context = compression.compress(tensor)
    if _no_grad_flows(compressed):
        # Building the autograd node costs as much as a small collective's own work.
        handle = _allreduce_start(
            compressed, None, name, reduce_op, prescale_factor, postscale_factor,
            process_set, grouped=False, in_place=False, blocking=True,
        )
        summed = _waited(handle)[0]
    else:
        summed = _AllreduceFunction.apply(
            compressed, name, reduce_op, prescale_factor, postscale_factor, process_set
        )
    return compression.decompress(summed, context)


@_takes_its_place(OpType.ALLREDUCE, "allreduce")
def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor`` itself. Not differentiable."""
    handle = _allreduce_start(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set,
        grouped=False, in_place=True, blocking=True,
    )
    return _waited(handle)[0]


@_takes_its_place(OpType.ALLREDUCE, "grouped_allreduce")
def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an out-of-place allreduce of a list of tensors as one unit; see
    :func:`grouped_allreduce`."""
    handle = _allreduce_start(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set,
        grouped=True, in_place=False, blocking=False,
    )
    return _register(handle, _as_tuple)


@_takes_its_place(OpType.ALLREDUCE, "grouped_allreduce")
def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an in-place grouped allreduce; see :func:`grouped_allreduce`."""
    handle = _allreduce_start(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set,
        grouped=True, in_place=True, blocking=False,
    )
    return _register(handle, _as_tuple)


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        prescale_factor: float,
        postscale_factor: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.op = op
        ctx.factors = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        handle = _allreduce_start(
            tensors, None, name, op, prescale_factor, postscale_factor, process_set,
            grouped=True, in_place=False, blocking=True,
        )
        return tuple(_waited(handle))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grads = grouped_allreduce(
            [g.contiguous() for g in grad_outputs],
            op=ctx.op,
            prescale_factor=ctx.factors[0],
            postscale_factor=ctx.factors[1],
            process_set=ctx.process_set,
        )
        return (None, None, None, None, None, *grads)


@_takes_its_place(OpType.ALLREDUCE, "grouped_allreduce")
def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allreduces a list of tensors as one unit (negotiated and completed together) and
    returns a list of new tensors. Arguments as for :func:`allreduce`; differentiable."""
    reduce_op = _resolve_op(average, op)
    if compression is Compression.none:
        compressed: Sequence[torch.Tensor] = list(tensors)
    else:
        compressed, contexts = zip(*(compression.compress(t) for t in tensors)) if tensors else (
            (), ()
        )
    if not torch.is_grad_enabled() or not any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in compressed
    ):
        # As in allreduce: no autograd node where no gradient can flow.
        handle = _allreduce_start(
            compressed, None, name, reduce_op, prescale_factor, postscale_factor,
            process_set, grouped=True, in_place=False, blocking=True,
        )
        reduced = _waited(handle)
    else:
        reduced = _GroupedAllreduceFunction.apply(
            name, reduce_op, prescale_factor, postscale_factor, process_set, *compressed
        )
    if compression is Compression.none:
        return list(reduced)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


@_takes_its_place(OpType.ALLREDUCE, "grouped_allreduce")
def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> tuple[torch.Tensor, ...]:
    """In-place :func:`grouped_allreduce`; returns the input tensors as a tuple."""
    handle = _allreduce_start(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set,
        grouped=True, in_place=True, blocking=True,
    )
    return tuple(_waited(handle))


@_takes_its_place(OpType.ALLGATHER, "allgather", suffixes=(".indices", ".values"))
def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Starts a sparse allreduce as two allgathers (indices and values).

    Returns a callable that waits and returns the reduced sparse tensor (duplicate indices
    are kept, not coalesced; ``Average`` divides the values by the set size).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async expects a sparse COO tensor.")
    reduce_op = to_reduce_op(op)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError("sparse_allreduce_async supports only Average and Sum.")
    indices = tensor._indices().transpose(0, 1).contiguous()
    values = tensor._values().contiguous()
    index_handle = allgather_async(
        indices, None if name is None else f"{name}.indices", process_set
    )
    value_handle = allgather_async(
        values, None if name is None else f"{name}.values", process_set
    )

    def wait() -> torch.Tensor:
        gathered_values = synchronize(value_handle)
        gathered_indices = synchronize(index_handle)
        if reduce_op == ReduceOp.AVERAGE:
            size = process_set.size() or 1
            gathered_values = gathered_values / size
        if gathered_values.numel() == 0:
            empty_indices = torch.empty((tensor.sparse_dim(), 0), dtype=torch.int64)
            empty_values = torch.empty((0, *tensor.shape[tensor.sparse_dim():]),
                                       dtype=tensor.dtype)
            return torch.sparse_coo_tensor(empty_indices, empty_values, size=tensor.size())
        return torch.sparse_coo_tensor(
            gathered_indices.transpose(0, 1), gathered_values, size=tensor.size()
        )

    return wait


# ---------------------------------------------------------------------------------------
# Allgather


@_takes_its_place(OpType.ALLGATHER, "allgather")
def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts an allgather; see :func:`allgather`. Returns a handle."""
    tensor = _check_tensor(tensor, _MOVABLE, "allgather")
    engine = runtime.require_engine()
    handle = engine.submit(
        OpType.ALLGATHER, "allgather", _process_set_id(process_set, "Allgather"), [tensor],
        None, name=name,
    )
    return _register(handle, _first)


@_takes_its_place(OpType.ALLGATHER, "grouped_allgather")
def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts a grouped allgather; see :func:`grouped_allgather`. Returns a handle."""
    tensors = _check_group(tensors, _MOVABLE, "grouped_allgather")
    engine = runtime.require_engine()
    handle = engine.submit(
        OpType.ALLGATHER, "grouped_allgather", _process_set_id(process_set, "Allgather"),
        tensors, None, name=name,
    )
    return _register(handle, _as_tuple)


def _rows_of_this_rank(first_dims: Sequence[int], process_set: ProcessSet) -> tuple[int, int]:
    member = process_set.rank() or 0
    return sum(first_dims[:member]), first_dims[member]


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        handle = _wait(allgather_async(tensor, name, process_set))
        ctx.first_dims = handle.extra[0]
        ctx.process_set = process_set
        return _first(handle)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        offset, rows = _rows_of_this_rank(ctx.first_dims, ctx.process_set)
        return reduced.narrow(0, offset, rows), None, None


@_takes_its_place(OpType.ALLGATHER, "allgather")
def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenates every member's ``tensor`` along dimension 0, in rank order.

    The first dimension may differ across ranks; the others must match. Differentiable: each
    rank's gradient is its own rows of the gradient averaged over the set.

    Args:
        tensor: a contiguous tensor of at least one dimension (any Horovod dtype).
        name: key that matches the request across ranks.
        process_set: the ranks taking part.
    """
    if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
        raise IndexError("tuple index out of range")
    return _AllgatherFunction.apply(tensor, name, process_set)


class _GroupedAllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        handle = _wait(grouped_allgather_async(tensors, name, process_set))
        ctx.first_dims = handle.extra
        ctx.process_set = process_set
        return _as_tuple(handle)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce(
            [g.contiguous() for g in grad_outputs], op=Average, process_set=ctx.process_set
        )
        grads = []
        for grad, dims in zip(reduced, ctx.first_dims):
            offset, rows = _rows_of_this_rank(dims, ctx.process_set)
            grads.append(grad.narrow(0, offset, rows))
        return (None, None, *grads)


@_takes_its_place(OpType.ALLGATHER, "grouped_allgather")
def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> tuple[torch.Tensor, ...]:
    """Allgathers each tensor of the list (negotiated together); returns a tuple.
    Differentiable like :func:`allgather`."""
    return _GroupedAllgatherFunction.apply(name, process_set, *tensors)


# ---------------------------------------------------------------------------------------
# Broadcast


def _broadcast_submit(
    tensor: torch.Tensor,
    output: torch.Tensor,
    root_rank: int,
    name: str | None,
    process_set: ProcessSet,
) -> Handle:
    engine = runtime.require_engine()
    ident = _process_set_id(process_set, "Broadcast")
    state = engine.process_sets.get(ident)
    if state is None or not isinstance(root_rank, int) or root_rank not in state.ranks:
        raise ValueError(
            f"broadcast received invalid root rank {root_rank} for provided process set"
        )
    return engine.submit(
        OpType.BROADCAST,
        "broadcast",
        ident,
        [tensor],
        [output],
        name=name,
        root=state.set_rank(root_rank),
    )


@_takes_its_place(OpType.BROADCAST, "broadcast")
def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an out-of-place broadcast; see :func:`broadcast`. Returns a handle."""
    tensor = _check_tensor(tensor, _MOVABLE, "broadcast")
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _register(_broadcast_submit(tensor, output, root_rank, name, process_set), _first)


@_takes_its_place(OpType.BROADCAST, "broadcast")
def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an in-place broadcast; see :func:`broadcast`. Returns a handle."""
    tensor = _check_tensor(tensor, _MOVABLE, "broadcast")
    return _register(_broadcast_submit(tensor, tensor, root_rank, name, process_set), _first)


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if runtime.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


@_takes_its_place(OpType.BROADCAST, "broadcast")
def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Returns the ``root_rank``'s ``tensor`` on every member; the input is not modified.

    Args:
        tensor: a contiguous tensor with the same shape and dtype on every rank.
        root_rank: the sending rank, as a global rank that belongs to ``process_set``.
        name: key that matches the request across ranks.
        process_set: the ranks taking part.

    Differentiable: the root receives the gradient averaged over the set, the others zeros.
    """
    return _BroadcastFunction.apply(tensor, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place :func:`broadcast`: overwrites ``tensor`` with the root's data and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------------------------------
# Alltoall


def _normalize_splits(
    tensor: torch.Tensor, splits: Any, group_size: int
) -> tuple[list[int] | None, torch.device]:
    if splits is None:
        if tensor.dim() == 0:
            return None, torch.device("cpu")
        if tensor.shape[0] % group_size:
            raise ValueError(
                "splits not provided, but first dimension of tensor is not an even multiple "
                "of the number of workers."
            )
        return [tensor.shape[0] // group_size] * group_size, torch.device("cpu")
    if not isinstance(splits, torch.Tensor):
        splits = torch.tensor(list(splits), dtype=torch.int32)
    if splits.dtype != torch.int32:
        raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
    if splits.dim() != 1:
        raise ValueError("alltoall expects a 1D splits tensor")
    values = [int(v) for v in splits.cpu().tolist()]
    if len(values) != group_size:
        raise ValueError("Number of entries in splits does not equal number of workers.")
    if any(v < 0 for v in values):
        raise ValueError(f"alltoall splits must not be negative, got {values}.")
    first = tensor.shape[0] if tensor.dim() else 0
    if sum(values) > first:
        raise ValueError("Sum of splits entries is greater than the first dimension of tensor.")
    return values, splits.device


@_takes_its_place(OpType.ALLTOALL, "alltoall")
def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an alltoall; see :func:`alltoall`. ``synchronize`` returns
    ``(received_tensor, received_splits)``."""
    tensor = _check_tensor(tensor, _MOVABLE, "alltoall")
    engine = runtime.require_engine()
    ident = _process_set_id(process_set, "Alltoall")
    state = engine.process_sets.get(ident)
    group_size = len(state.ranks) if state is not None else 1
    values, device = _normalize_splits(tensor, splits, group_size)
    handle = engine.submit(
        OpType.ALLTOALL, "alltoall", ident, [tensor], None, name=name, splits=values
    )

    def finish(done: Handle) -> tuple[torch.Tensor, torch.Tensor]:
        received = torch.tensor(done.extra, dtype=torch.int32, device=device)
        return _first(done), received

    return _register(handle, finish)


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.rows = tensor.shape[0]
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, _unused: Any) -> tuple[Any, ...]:
        grad, _ = alltoall(
            grad_output.contiguous(), splits=ctx.received, process_set=ctx.process_set
        )
        if grad.shape[0] < ctx.rows:
            padding = grad.new_zeros((ctx.rows - grad.shape[0], *grad.shape[1:]))
            grad = torch.cat([grad, padding])
        return grad, None, None, None


@_takes_its_place(OpType.ALLTOALL, "alltoall")
def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatters slices of ``tensor`` to the members and gathers the slices they send.

    Args:
        tensor: a contiguous tensor; its dimension 0 is cut into slices.
        splits: rows sent to each member (list or int32 tensor of the set's size). Default:
            equal slices, which needs dimension 0 divisible by the set size. Rows after
            ``sum(splits)`` are not sent.
        name: key that matches the request across ranks.
        process_set: the ranks taking part.

    Returns:
        The received rows concatenated in rank order; with ``splits`` given, the pair
        ``(received_tensor, received_splits)`` (int32, on the device of ``splits``).
        Differentiable: the gradient is the reverse alltoall.
    """
    output, received = _AlltoallFunction.apply(tensor, splits, name, process_set)
    if splits is None:
        return output
    return output, received


# ---------------------------------------------------------------------------------------
# Reducescatter


def _reducescatter_op(op: int) -> ReduceOp:
    reduce_op = to_reduce_op(op)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise _ArgumentError("Reducescatter currently only supports AVERAGE and SUM.")
    return reduce_op


def _reducescatter_submit(
    tensors: list[torch.Tensor],
    label: str,
    name: str | None,
    op: int,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
) -> Handle:
    reduce_op = _reducescatter_op(op)
    for tensor in tensors:
        if tensor.dim() == 0:
            raise ValueError("Reducescatter does not support scalar inputs")
    engine = runtime.require_engine()
    return engine.submit(
        OpType.REDUCESCATTER,
        label,
        _process_set_id(process_set, "Reducescatter"),
        tensors,
        None,
        name=name,
        reduce_op=reduce_op,
        prescale=prescale_factor,
        postscale=postscale_factor,
    )


@_takes_its_place(OpType.REDUCESCATTER, "reducescatter")
def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts a reducescatter; see :func:`reducescatter`. Returns a handle."""
    tensor = _check_tensor(tensor, _REDUCIBLE, "reducescatter")
    handle = _reducescatter_submit(
        [tensor], "reducescatter", name, op, process_set, prescale_factor, postscale_factor
    )
    return _register(handle, _first)


@_takes_its_place(OpType.REDUCESCATTER, "grouped_reducescatter")
def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts a grouped reducescatter; see :func:`grouped_reducescatter`."""
    tensors = _check_group(tensors, _REDUCIBLE, "grouped_reducescatter")
    handle = _reducescatter_submit(
        tensors, "grouped_reducescatter", name, op, process_set, prescale_factor,
        postscale_factor,
    )
    return _register(handle, _as_tuple)


def _reducescatter_grad(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    gathered = allgather(grad.contiguous(), process_set=ctx.process_set)
    factor = ctx.factors[0] * ctx.factors[1]
    if ctx.op == ReduceOp.SUM:
        factor *= ctx.process_set.size() or 1
    return gathered * factor if factor != 1 else gathered


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        process_set: ProcessSet,
        prescale_factor: float,
        postscale_factor: float,
    ) -> torch.Tensor:
        ctx.op = op
        ctx.process_set = process_set
        ctx.factors = (prescale_factor, postscale_factor)
        return synchronize(
            reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor)
        )

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        return _reducescatter_grad(ctx, grad_output), None, None, None, None, None


@_takes_its_place(OpType.REDUCESCATTER, "reducescatter")
def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduces ``tensor`` over the members and returns this rank's slice of dimension 0.

    Member r receives ``dim0 // n + (1 if r < dim0 % n else 0)`` rows; slices are contiguous
    in rank order. Note Horovod's argument order (``op`` before ``process_set``, factors last)
    and default ``op=Average``.

    Args:
        tensor: a contiguous tensor of at least one dimension, same shape on every rank.
        name: key that matches the request across ranks.
        compression: compresses the tensor before sending.
        op: ``Average`` or ``Sum``.
        process_set: the ranks taking part.
        prescale_factor: multiplies each rank's tensor before the reduction.
        postscale_factor: multiplies the result.

    Differentiable: the gradient is the allgather of the incoming gradient (times the set
    size for ``Sum``, times the factors).
    """
    reduce_op = _reducescatter_op(op)
    compressed, context = compression.compress(tensor)
    reduced = _ReducescatterFunction.apply(
        compressed, name, reduce_op, process_set, prescale_factor, postscale_factor
    )
    return compression.decompress(reduced, context)


class _GroupedReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        process_set: ProcessSet,
        prescale_factor: float,
        postscale_factor: float,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.op = op
        ctx.process_set = process_set
        ctx.factors = (prescale_factor, postscale_factor)
        return synchronize(
            grouped_reducescatter_async(
                tensors, name, op, process_set, prescale_factor, postscale_factor
            )
        )

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        return (None,) * 5 + tuple(_reducescatter_grad(ctx, g) for g in grad_outputs)


@_takes_its_place(OpType.REDUCESCATTER, "grouped_reducescatter")
def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatters each tensor of the list (negotiated together); returns a list.
    Arguments as for :func:`reducescatter`."""
    reduce_op = _reducescatter_op(op)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _GroupedReducescatterFunction.apply(
        name, reduce_op, process_set, prescale_factor, postscale_factor, *(p[0] for p in pairs)
    )
    return [compression.decompress(t, p[1]) for t, p in zip(reduced, pairs)]


# ---------------------------------------------------------------------------------------
# Join and barrier


def join(device: int = -1) -> int:
    """Declares that this rank has no more data and waits until every rank has joined.

    Until then, the other ranks' allreduces proceed with this rank contributing zeros
    (``Average`` still divides by the full set size); other collectives fail while a rank
    has joined. Returns the rank that joined last, the same on every rank.

    Args:
        device: accepted for compatibility; the zeros go where the collective runs (for
            GPU collectives, the GPU of this rank's earlier GPU collectives).
    """
    engine = runtime.require_engine()
    handle = engine.submit(OpType.JOIN, "join", GLOBAL_PROCESS_SET_ID, [], None)
    handle.wait()
    return int(handle.extra)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Blocks until every member of ``process_set`` has called it."""
    engine = runtime.require_engine()
    handle = engine.submit(
        OpType.BARRIER, "barrier", _process_set_id(process_set, "Barrier"), [], None
    )
    handle.wait()


def _check_has_gpu() -> bool:
    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------
# Timeline


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing the timeline, a Chrome trace of every collective, to ``file_path``.

    Only rank 0 writes; on the other ranks the call does nothing. A timeline being written
    is closed first. See :mod:`baguahvd.engine.timeline` for the activities recorded.

    Args:
        file_path: the JSON file to write.
        mark_cycles: also mark the start of each negotiation cycle (``CYCLE_START``).

    Raises:
        ValueError: before ``init()``, or when ``HOROVOD_TIMELINE`` was not set at
            ``init()`` (set it to ``DYNAMIC`` to start the timeline only from code).
    """
    runtime.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stops the timeline started by :func:`start_timeline` or ``HOROVOD_TIMELINE`` and
    closes its file."""
    runtime.stop_timeline()
