"""Runs agreed responses on a communicator: the tensor arithmetic of every collective.

Scaling follows Horovod: ``result = postscale * REDUCE(prescale * x_r)``; integers are scaled
in float64 and truncated toward zero, float16/bfloat16 in float32 and rounded once.
``Average`` is ``Sum`` with the postscale divided by the group size, unless the
communicator averages floating tensors itself (NCCL's ``ncclAvg``) and there is no postscale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from baguahvd.backends.base import Communicator, Started
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.buffers import ByteCount, FusionBuffers
from baguahvd.engine.execution.scaling import scale_, scaled
from baguahvd.engine.messages import DTYPES, Response
from baguahvd.engine.requests import Entry, Request
from baguahvd.kernels import host_copy


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _factors(response: Response, comm: Communicator) -> tuple[ReduceOp, float, float]:
    """The op ``comm`` runs and the factors applied before and after it.

    AVERAGE stays AVERAGE when ``comm`` averages the response's dtype in its reduction
    (:meth:`~Communicator.reduces_average`) and no postscale asks for a scaling pass anyway;
    otherwise it is SUM with the postscale divided by the group size: one scaling pass after
    the reduction either way. The prescale applies to the inputs in both cases.
    """
    op = response.meta.reduce_op
    post = response.meta.postscale
    if op == ReduceOp.AVERAGE:
        if post == 1.0 and comm.reduces_average(DTYPES[response.meta.dtype]):
            return ReduceOp.AVERAGE, response.meta.prescale, 1.0
        return ReduceOp.SUM, response.meta.prescale, post / comm.size
    return op, response.meta.prescale, post


def _joined_device(
    comm: Communicator, response: Response, user_device: torch.device | None = None
) -> torch.device:
    """Where a member that joined puts its zeros: the GPU its communicator uses, else the
    one its user thread submitted from (never the engine thread's own current device, which
    is GPU 0 until a device collective selects one)."""
    if response.meta.device == "CPU":
        return torch.device("cpu")
    device = getattr(comm, "device", None)
    if isinstance(device, torch.device):
        return device
    if user_device is not None:
        return user_device
    return torch.device("cuda", torch.cuda.current_device())


def _inputs_outputs(
    entry: Entry, dtype: torch.dtype, comm: Communicator,
    user_device: torch.device | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    response, request = entry
    if request is None:
        # A member that joined: it contributes zeros and keeps nothing.
        device = _joined_device(comm, response, user_device)
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape in response.meta.shapes]
        return zeros, zeros
    assert request.outputs is not None
    return request.inputs, request.outputs


def allreduce(
    comm: Communicator,
    entries: Sequence[Entry],
    buffers: FusionBuffers,
    phase: Callable[[str], None] | None = None,
    user_device: torch.device | None = None,
    split: bool = False,
    copied: ByteCount | None = None,
    started: list[Started] | None = None,
) -> Callable[[], None] | None:
    """Allreduces every tensor of ``entries`` (same dtype, op and factors) in one call.

    ``phase`` (for the timeline) is told when each step begins: ``MEMCPY_IN_FUSION_BUFFER``,
    ``COMMUNICATE`` and ``MEMCPY_OUT_FUSION_BUFFER``; unfused tensors only communicate.

    ``split`` (a device unit, launched without waiting): only the steps up to the
    communication run here, and the rest, which writes the outputs from the communication's
    results (the scaling after it, the copy out of the fusion buffer), is returned for the
    caller to run once the communication has finished without error; None when nothing is
    left (an unfused tensor without a postscale, which the communication writes itself).
    Without ``split`` everything runs here and None is returned. ``started`` (with
    ``split``: a host unit launched without waiting) collects the reductions started with
    :meth:`~Communicator.start_allreduce`; the rest waits until all have completed.

    ``copied`` counts the bytes copied into and out of the fusion buffer. An allreduce
    submitted with ``fuse=False`` (a unit of its own) reduces each of its tensors in place,
    without the buffer.
    """
    if phase is None:
        phase = _no_phase
    first = entries[0][0]
    dtype = DTYPES[first.meta.dtype]
    if first.meta.reduce_op == ReduceOp.ADASUM:
        phase("COMMUNICATE")
        targets: list[torch.Tensor] = []
        results: list[torch.Tensor] = []
        for entry in entries:
            for tensor_in, tensor_out in zip(*_inputs_outputs(entry, dtype, comm, user_device)):
                if not split:
                    adasum(comm, tensor_in, tensor_out, first.meta.prescale, first.meta.postscale)
                    continue
                # Into a tensor of its own, copied out with the rest.
                result = torch.empty_like(tensor_out)
                adasum(comm, tensor_in, result, first.meta.prescale, first.meta.postscale)
                targets.append(tensor_out)
                results.append(result)
        return (lambda: host_copy.copy_all(targets, results)) if split else None
    op, pre, post = _factors(first, comm)
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    for entry in entries:
        request = entry[1]
        if request is not None and request.outputs is not None:
            inputs += request.inputs
            outputs += request.outputs
        else:
            zeros, _ = _inputs_outputs(entry, dtype, comm, user_device)
            inputs += zeros
            outputs += zeros
    if len(inputs) == 1 or not first.meta.fuse:
        phase("COMMUNICATE")
        rests = [
            rest
            for tensor_in, tensor_out in zip(inputs, outputs)
            if (rest := _allreduce_alone(
                comm, tensor_in, tensor_out, op, pre, post, split, started
            ))
        ]
        if len(rests) < 2:
            return rests[0] if rests else None

        def rest_of_all() -> None:
            for rest in rests:
                rest()

        return rest_of_all
    phase("MEMCPY_IN_FUSION_BUFFER")
    shapes = tuple(shape for entry in entries for shape in entry[0].meta.shapes)
    host = first.meta.device == "CPU"
    buffer, views = buffers.views(dtype, inputs[0].device, shapes, host)
    nbytes = buffer.numel() * buffer.element_size()
    # One call each way rather than a copy per tensor: fewer GIL round trips while the
    # training thread is busy submitting (host_copy: torch.cat, or a memcpy per tensor).
    if host:
        host_copy.gather(inputs, buffer, views, all(len(shape) == 1 for shape in shapes))
    else:
        host_copy.copy_all(views, inputs)
    if copied is not None:
        copied.add(nbytes)
    scale_(buffer, pre)
    phase("COMMUNICATE")
    if split:
        _start(comm, buffer, buffer, op, started)
        return lambda: _scale_and_copy_out(buffer, views, outputs, post, phase, copied)
    _reduce_scaled(comm, buffer, buffer, op, post)
    _copy_out(buffer, views, outputs, phase, copied)
    return None


def _allreduce_alone(
    comm: Communicator, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp,
    pre: float, post: float, split: bool, started: list[Started] | None,
) -> Callable[[], None] | None:
    """One tensor's allreduce without the fusion buffer; with ``split``, returns the
    scaling after it where there is one (see :func:`allreduce`)."""
    source = scaled(tensor_in, pre) if pre != 1.0 else tensor_in
    if split:
        _start(comm, source, tensor_out, op, started)
        return (lambda: scale_(tensor_out, post)) if post != 1.0 else None
    _reduce_scaled(comm, source, tensor_out, op, post)
    return None


def _start(
    comm: Communicator, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp,
    started: list[Started] | None,
) -> None:
    """The communication of a split allreduce: queued on a device communicator's stream,
    or started on a host transport's threads and listed in ``started``."""
    if started is None:
        comm.allreduce(tensor_in, tensor_out, op)
    else:
        started.append(comm.start_allreduce(tensor_in, tensor_out, op))


def _scale_and_copy_out(
    buffer: torch.Tensor, views: list[torch.Tensor], outputs: list[torch.Tensor], post: float,
    phase: Callable[[str], None], copied: ByteCount | None,
) -> None:
    """The rest of a split fused allreduce (see :func:`allreduce`)."""
    scale_(buffer, post)
    _copy_out(buffer, views, outputs, phase, copied)


def _copy_out(
    buffer: torch.Tensor, views: list[torch.Tensor], outputs: list[torch.Tensor],
    phase: Callable[[str], None], copied: ByteCount | None,
) -> None:
    """The copy out of a fused allreduce's ``buffer`` into the users' ``outputs``."""
    phase("MEMCPY_OUT_FUSION_BUFFER")
    if buffer.is_cpu:
        host_copy.scatter(buffer, views, outputs)
    else:
        host_copy.copy_all(outputs, views)
    if copied is not None:
        copied.add(buffer.numel() * buffer.element_size())


def _reduce_scaled(
    comm: Communicator, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp,
    post: float,
) -> None:
    if post == 1.0:
        comm.allreduce(tensor_in, tensor_out, op)
    else:
        comm.allreduce_scaled(tensor_in, tensor_out, op, lambda part: scale_(part, post))


def _no_phase(activity: str) -> None:
    pass


def adasum(
    comm: Communicator,
    tensor_in: torch.Tensor,
    tensor_out: torch.Tensor,
    prescale: float = 1.0,
    postscale: float = 1.0,
) -> None:
    """Adasum (Maleki et al., 2020) by recursive doubling over a power-of-two group.

    At each level, partners ``r`` and ``r ^ d`` exchange their current vectors ``a`` (lower
    rank) and ``b`` and both compute
    ``(1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b`` with the operands in the same order,
    so every rank ends with bit-identical results. Dot products accumulate in float64.
    """
    work = tensor_in.reshape(-1).to(torch.float64) * prescale
    distance = 1
    while distance < comm.size:
        peer = comm.rank ^ distance
        other = torch.empty_like(work)
        comm.sendrecv(work, other, peer)
        a, b = (work, other) if comm.rank < peer else (other, work)
        dot = torch.dot(a, b)
        a_sq = torch.dot(a, a)
        b_sq = torch.dot(b, b)
        # Chosen on the device: a host test of a_sq would wait for the GPU in the engine
        # thread, outside the collective's deadline.
        one = torch.ones((), dtype=a.dtype, device=a.device)
        a_coeff = torch.where(a_sq > 0, 1.0 - dot / (2.0 * a_sq), one)
        b_coeff = torch.where(b_sq > 0, 1.0 - dot / (2.0 * b_sq), one)
        work = a_coeff * a + b_coeff * b
        distance <<= 1
    work *= postscale
    if tensor_out.is_floating_point():
        tensor_out.view(-1).copy_(work)
    else:
        tensor_out.view(-1).copy_(torch.trunc(work))


def allgather(comm: Communicator, response: Response, request: Request) -> list[torch.Tensor]:
    outputs = []
    for index, tensor_in in enumerate(request.inputs):
        dims = response.first_dims[index]
        row = numel(tensor_in.shape[1:])
        tensor_out = torch.empty(
            (sum(dims), *tensor_in.shape[1:]), dtype=tensor_in.dtype, device=tensor_in.device
        )
        comm.allgather(tensor_in, tensor_out, [d * row for d in dims])
        outputs.append(tensor_out)
    return outputs


def broadcast(comm: Communicator, response: Response, request: Request) -> list[torch.Tensor]:
    assert request.outputs is not None
    tensor_in, tensor_out = request.inputs[0], request.outputs[0]
    if comm.rank == response.meta.root and tensor_out is not tensor_in:
        tensor_out.copy_(tensor_in)
    comm.broadcast(tensor_out, response.meta.root)
    return [tensor_out]


def alltoall(
    comm: Communicator, response: Response, request: Request
) -> tuple[list[torch.Tensor], list[int]]:
    tensor_in = request.inputs[0]
    row = numel(tensor_in.shape[1:])
    sent = response.splits[comm.rank]
    received = [splits[comm.rank] for splits in response.splits]
    tensor_out = torch.empty(
        (sum(received), *tensor_in.shape[1:]), dtype=tensor_in.dtype, device=tensor_in.device
    )
    comm.alltoall(tensor_in, [s * row for s in sent], tensor_out, [r * row for r in received])
    return [tensor_out], received


def reducescatter_rows(rows: int, group_size: int) -> list[int]:
    """Rows of dim 0 each member receives: lower ranks get the remainder."""
    base, extra = divmod(rows, group_size)
    return [base + (1 if r < extra else 0) for r in range(group_size)]


def reducescatter(
    comm: Communicator, response: Response, request: Request
) -> list[torch.Tensor]:
    op, pre, post = _factors(response, comm)
    outputs = []
    for tensor_in in request.inputs:
        rows = reducescatter_rows(tensor_in.shape[0], comm.size)
        row = numel(tensor_in.shape[1:])
        source = scaled(tensor_in, pre) if pre != 1.0 else tensor_in
        tensor_out = torch.empty(
            (rows[comm.rank], *tensor_in.shape[1:]),
            dtype=tensor_in.dtype,
            device=tensor_in.device,
        )
        comm.reduce_scatter(source.contiguous(), tensor_out, [r * row for r in rows], op)
        scale_(tensor_out, post)
        outputs.append(tensor_out)
    return outputs


def any_inference(unit: list[Entry]) -> bool:
    """Whether a tensor of the unit's requests was made in inference mode (an in-place
    request's outputs are its inputs: checked once)."""
    for _, request in unit:
        if request is None:
            continue
        for tensor in request.inputs:
            if tensor.is_inference():
                return True
        outputs = request.outputs
        if outputs is not None and outputs is not request.inputs:
            for tensor in outputs:
                if tensor.is_inference():
                    return True
    return False


def without_grad(call: Callable[[], None], inference: bool) -> None:
    """``call()`` without autograd, in inference mode where the unit's tensors need it
    (see :meth:`~baguahvd.engine.execution.dispatch.Dispatcher.execute`)."""
    with torch.inference_mode() if inference else torch.no_grad():
        call()
