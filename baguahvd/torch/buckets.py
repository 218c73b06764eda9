"""Copy-free gradient buckets for DistributedOptimizer's default path.

The protocol, per optimizer:

1. The first synchronized step runs the per-tensor path and records, on every rank, the
   order in which gradients became due (their countdown reached zero in a hook, or
   ``synchronize()`` forced them) and when, which of them arrived sparse, and which
   arrived at all.
2. At the end of that ``synchronize()`` the members of the process set agree on a layout
   (:func:`agree_layout`): the first member's order, without the parameters that some member
   cannot bucket (sparse gradients, non-contiguous or channels_last parameters, dtypes other
   than float16, bfloat16, float32 and float64) and those no member received a gradient for.
   One allreduce of flags and one broadcast, once. :func:`plan_buckets` then splits that
   order by dtype and device into buckets of up to the engine's fusion threshold (a bucket
   of a few kilobytes takes the next parameter past it), and before a gradient that the
   first member saw due well after the one before it; each of the user's ``groups`` whose
   members can all be bucketed is a bucket of its own.
3. Each bucket owns one flat buffer, and each member's ``.grad`` becomes a view of it, so
   that autograd accumulates straight into the buffer. ``zero_grad()`` sets gradients to
   None, as torch's does; just before autograd accumulates the bucket's first gradient of
   a step (a pre-hook on that parameter's gradient accumulator, :meth:`GradientBucket.fill`),
   the members without a gradient get their views back, zeroed. So a buffer is zeroed
   when backward reaches it, not at ``zero_grad()``: on the CPU, zeroing every bucket
   before the forward pass put the whole memset (33.6 MB: about 2 ms on two ranks) ahead
   of the first bucket's transfer. A gradient found replaced when it becomes due
   (assigned by the user, rebuilt by ``create_graph``, accumulated before the bucket's
   first) is copied into its view, and ``.grad`` points at the view again.
4. When the last member of a bucket is due, the flat buffer (compressed as a whole with the
   built-in fp16/bf16 compressors) is allreduced in place as one request, which the engine
   neither fuses with others nor copies. The request is named
   ``DistributedOptimizer.bucket.<index>[<name>,<name>,...]``, so that mismatch and stall
   reports list the parameters inside.

Sums are elementwise, so a bucket gives every gradient the same value as allreducing it
alone with the same op and factors.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from baguahvd.backends import memory
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.requests import Handle
from baguahvd.runtime.process_sets import ProcessSet
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.compression import Compression
from baguahvd.torch.functions import broadcast_object
from baguahvd.torch.mpi_ops import allreduce_, bucket_allreduce_async_

BUCKET_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dtypes whose gradients go into buckets; the others are reduced one by one."""

BUCKET_COMPRESSIONS = (Compression.none, Compression.fp16, Compression.bf16)
"""Compressors that work elementwise, so that compressing a bucket compresses each
gradient in it exactly as compressing it alone would."""


def bucket_name(index: int, names: Sequence[str]) -> str:
    """The name of a bucket's request: its index and the names of its parameters."""
    return f"DistributedOptimizer.bucket.{index}[{','.join(names)}]"


def bucket_threshold(fusion_threshold: int, bucket_bytes: int) -> int:
    """Bytes per bucket: the fusion threshold, capped at ``bucket_bytes``
    (BAGUAHVD_BUCKET_SIZE). A bucket is sent only once all of its gradients are ready, so
    one bucket of the whole 128 MiB default threshold would start no communication until
    the backward pass ends; smaller buckets let the first ones travel while backward still
    runs, as the fusion buffer does with what each cycle finds ready. A threshold of 0
    (fusion disabled) gives every parameter a bucket of its own."""
    if fusion_threshold <= 0 or bucket_bytes <= 0:
        return fusion_threshold
    return min(fusion_threshold, bucket_bytes)


BREAK_GAP_S = 1e-3
"""A gradient that became due this long after the one before it, in the first member's
first step, starts a new bucket (see :func:`plan_buckets`)."""
BREAK_MIN_BYTES = 1 << 20
"""A late gradient starts a new bucket only once the bucket it would join holds this many
bytes: enough to be worth a collective of its own."""
SMALL_BUCKET_BYTES = 64 << 10
"""A bucket holding fewer bytes than this (and than a sixteenth of the threshold) is not
closed for size: it takes the next parameter past the threshold. Alone it would cost a
collective of its own, about a millisecond of latency and negotiation even at 1 Gbit/s,
where 64 KiB take half a millisecond on the link (a layer's bias that a late break left on
its own took 4.6 ms, ``benchmarks/results/emulated_1gbit_0507906/NOTES.md``)."""


def readiness_breaks(order: Sequence[str], times: Sequence[float]) -> list[str]:
    """The names in ``order`` (due at ``times``, in seconds) that became due at least
    :data:`BREAK_GAP_S` after the name before them."""
    return [
        name for index, name in enumerate(order)
        if index and times[index] - times[index - 1] >= BREAK_GAP_S
    ]


def plan_buckets(
    order: Sequence[str],
    keys: Mapping[str, Hashable],
    sizes: Mapping[str, int],
    threshold: int,
    breaks: Collection[str] = (),
) -> list[list[str]]:
    """Splits ``order`` into buckets: consecutive parameters of one key (dtype and device)
    share a bucket while its bytes stay within ``threshold``; a parameter larger than
    ``threshold`` has a bucket to itself (or shares a small one, below), and every
    parameter has one when ``threshold`` is 0 or less.

    A parameter in ``breaks`` (due well after the one before it, :func:`readiness_breaks`)
    starts a new bucket when the open one already holds :data:`BREAK_MIN_BYTES`: a bucket
    is sent once its last gradient is due, so a small gradient due late would hold back
    the large ones due early (a layer's bias, due with the next layer's weight). A bucket
    of fewer than :data:`SMALL_BUCKET_BYTES` and a sixteenth of ``threshold`` takes the
    next parameter whatever its size (the bias that a break leaves on its own joins the
    weight after it). Buckets are listed in the order of their first parameter."""
    buckets: list[list[str]] = []
    open_buckets: dict[Hashable, tuple[list[str], int]] = {}
    breaks = frozenset(breaks)
    small = min(SMALL_BUCKET_BYTES, threshold // 16)
    for name in order:
        key, size = keys[name], sizes[name]
        current = open_buckets.get(key)
        if current is not None and (
            (current[1] + size > threshold and current[1] >= small)
            or (name in breaks and current[1] >= BREAK_MIN_BYTES)
        ):
            current = None
        if current is None:
            current = ([], 0)
            buckets.append(current[0])
        current[0].append(name)
        open_buckets[key] = (current[0], current[1] + size)
    return buckets


def can_bucket(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient can be a view of a flat buffer that autograd accumulates
    into: a dense, non-empty, contiguous floating-point parameter (channels_last and other
    strided layouts keep gradients of their own layout)."""
    return (
        p.layout == torch.strided
        and p.dtype in BUCKET_DTYPES
        and p.numel() > 0
        and p.is_contiguous()
    )


@dataclasses.dataclass
class Recording:
    """What the first synchronized step saw of the gradients on this rank."""

    order: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Parameters in the order their gradients became due, each once."""
    times: list[float] = dataclasses.field(default_factory=list)
    """When each of :attr:`order` became due (``time.perf_counter``)."""
    seen: set[torch.Tensor] = dataclasses.field(default_factory=set)
    """Parameters whose gradient autograd produced."""
    sparse: set[torch.Tensor] = dataclasses.field(default_factory=set)
    """Parameters whose gradient arrived sparse."""

    listed: set[torch.Tensor] = dataclasses.field(default_factory=set)

    def saw(self, p: torch.Tensor) -> None:
        """Records that autograd produced a gradient for ``p``."""
        self.seen.add(p)
        if p.grad is not None and p.grad.is_sparse:
            self.sparse.add(p)

    def due(self, p: torch.Tensor) -> None:
        """Records that ``p``'s gradient became due (in a hook, or forced by synchronize)."""
        if p not in self.listed:
            self.listed.add(p)
            self.order.append(p)
            self.times.append(time.perf_counter())


def agree_layout(
    recording: Recording,
    names: Mapping[torch.Tensor, str],
    tracked: Iterable[torch.Tensor],
    threshold: int,
    process_set: ProcessSet,
) -> tuple[list[str], int, list[str]]:
    """The bucketable parameter names in the first member's order, the first member's
    fusion ``threshold`` and its :func:`readiness_breaks`: the same on every member
    (collective over ``process_set``)."""
    by_name = sorted((names[p], p) for p in tracked)
    local = torch.tensor(
        [int(p in recording.sparse or not can_bucket(p)) for _, p in by_name]
        + [int(p in recording.seen) for _, p in by_name],
        dtype=torch.int32,
    )
    totals = allreduce_(
        local, name="DistributedOptimizer.bucket_layout.flags", op=ReduceOp.SUM,
        process_set=process_set,
    ).tolist()
    count = len(by_name)
    allowed = {
        name for index, (name, _) in enumerate(by_name)
        if totals[index] == 0 and totals[count + index] > 0
    }
    root = process_set.ranks[0] if process_set.ranks else 0
    mine = [names[p] for p in recording.order]
    order, threshold, breaks = broadcast_object(
        (mine, threshold, readiness_breaks(mine, recording.times)), root,
        name="DistributedOptimizer.bucket_layout.order", process_set=process_set,
    )
    listed = set(order)
    order += sorted(name for name, _ in by_name if name not in listed)
    return [name for name in order if name in allowed], threshold, breaks


class GradientBucket:
    """One flat buffer and the parameters whose gradients are views of it."""

    def __init__(self, index: int, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
        first = params[0]
        self.name = bucket_name(index, names)
        self.params = tuple(params)
        self.buffer = memory.zeros_buffer(sum(p.numel() for p in params), first)
        views = []
        offset = 0
        for p in params:
            views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.views = tuple(views)
        self.remaining = len(params)
        """Members not yet due in this step."""
        self.in_flight: tuple[Handle, torch.Tensor, Any] | None = None
        """The handle, the tensor sent and the compressor's context of this step's request."""

    def attach(self) -> None:
        """Moves the current gradients into the views and points ``.grad`` at them (not
        for a member frozen since the layout was agreed: its gradient stays None)."""
        for p, view in zip(self.params, self.views):
            if p.requires_grad or p.grad is not None:
                adopt(p, view)

    def fill(self) -> None:
        """Points every member that trains and has no gradient at its view, zeroed: the
        whole buffer in one pass when no member holds its view (after ``zero_grad()``),
        else only the views it hands out. Runs before autograd accumulates the bucket's
        first gradient of a step."""
        params, views = self.params, self.views
        missing = [
            index for index, p in enumerate(params) if p.grad is None and p.requires_grad
        ]
        if not missing:
            return
        if any([p.grad is view for p, view in zip(params, views)]):
            for index in missing:
                adopt(params[index], views[index])
            return
        self.buffer.zero_()
        for index in missing:
            params[index].grad = views[index]


def adopt(p: torch.Tensor, view: torch.Tensor) -> None:
    """Makes ``view`` the gradient of ``p``, holding what ``p.grad`` holds (zeros for None)."""
    grad = p.grad
    if grad is view:
        return
    if grad is None:
        view.zero_()
    else:
        view.copy_(grad.to_dense() if grad.is_sparse else grad)
    p.grad = view


class GradientBuckets:
    """The buckets of one optimizer and how they are reduced (see module docstring)."""

    def __init__(
        self,
        layout: Sequence[Sequence[str]],
        params: Mapping[str, torch.Tensor],
        op: ReduceOp,
        factors: tuple[float, float],
        compression: Any,
        process_set: ProcessSet,
        order: Sequence[str] = (),
    ) -> None:
        self.buckets = [
            GradientBucket(index, names, [params[name] for name in names])
            for index, names in enumerate(layout)
        ]
        self.slots: dict[torch.Tensor, tuple[GradientBucket, torch.Tensor]] = {
            p: (bucket, view)
            for bucket in self.buckets
            for p, view in zip(bucket.params, bucket.views)
        }
        self.op = op
        self.factors = factors
        self.compression = compression
        self.process_set = process_set
        self.engine = runtime.engine
        """The engine the layout was agreed with; a new one (an elastic reset) means other
        members may have none."""
        for bucket in self.buckets:
            bucket.attach()
        position = {name: index for index, name in enumerate(order)}
        self.fills = [
            _fill_before_accumulating(
                params[min(names, key=lambda name: position.get(name, len(position)))],
                bucket,
            )
            for bucket, names in zip(self.buckets, layout)
        ]
        """Per bucket, the gradient accumulator of the member that ``order`` (the agreed
        order in which gradients became due) lists first, and the handle of its pre-hook,
        which fills the bucket (:meth:`GradientBucket.fill`). Held: autograd keeps a
        parameter's accumulator, and so its hooks, only while something refers to it."""

    def close(self) -> None:
        """Removes the pre-hooks (the optimizer drops these buckets)."""
        for _, handle in self.fills:
            handle.remove()
        self.fills = []

    def due(self, p: torch.Tensor) -> bool:
        """Marks the gradient of ``p`` as due; submits its bucket when it is the last.
        False when ``p`` has no bucket."""
        slot = self.slots.get(p)
        if slot is None:
            return False
        bucket, view = slot
        if p.grad is not view:
            adopt(p, view)
        bucket.remaining -= 1
        if bucket.remaining == 0:
            self._submit(bucket)
        return True

    def _submit(self, bucket: GradientBucket) -> None:
        wire, ctx = self.compression.compress(bucket.buffer)
        pre, post = self.factors
        handle = bucket_allreduce_async_(wire, bucket.name, self.op, pre, post, self.process_set)
        bucket.in_flight = (handle, wire, ctx)

    def force(self) -> None:
        """Submits every bucket not yet submitted, with whatever its gradients hold (zeros
        for those that are None)."""
        for bucket in self.buckets:
            if bucket.in_flight is None:
                bucket.attach()
                self._submit(bucket)

    def wait(self) -> None:
        """Waits for every bucket's request and writes decompressed results back; makes the
        buckets ready for the next step, also when a request failed."""
        try:
            for bucket in self.buckets:
                assert bucket.in_flight is not None
                handle, wire, ctx = bucket.in_flight
                handle.wait()
                if wire is not bucket.buffer:
                    bucket.buffer.copy_(self.compression.decompress(wire, ctx))
                for p, view in zip(bucket.params, bucket.views):
                    grad = p.grad
                    if grad is not view:
                        # Replaced after backward (fuse_optimizer makes gradients views of
                        # its own buffers): the result goes where the gradient now is.
                        if grad is None:
                            if p.requires_grad:  # else frozen since: no gradient to step
                                p.grad = view
                        elif grad.is_sparse:
                            p.grad = view
                        else:
                            grad.copy_(view)
        finally:
            self.reset()

    def reset(self) -> None:
        """Forgets this step's progress (its requests are abandoned, not waited for)."""
        for bucket in self.buckets:
            bucket.in_flight = None
            bucket.remaining = len(bucket.params)


def _fill_before_accumulating(p: torch.Tensor, bucket: GradientBucket) -> tuple[Any, Any]:
    """Registers ``bucket.fill`` as a pre-hook of ``p``'s gradient accumulator, which runs
    in ``backward()`` only (not in ``torch.autograd.grad``), just before autograd adds
    ``p``'s gradient to ``p.grad``; returns the accumulator and the hook's handle."""
    with torch.inference_mode(False), torch.enable_grad():
        node = p.view_as(p).grad_fn
    accumulator = None if node is None else node.next_functions[0][0]
    assert accumulator is not None  # p is a leaf that requires grad

    def fill(_: Any) -> None:
        bucket.fill()

    return accumulator, accumulator.register_prehook(fill)


def layout_with_groups(
    order: Sequence[str],
    params: Mapping[str, torch.Tensor],
    groups: Sequence[Sequence[torch.Tensor]],
    names: Mapping[torch.Tensor, str],
    threshold: int,
    breaks: Collection[str] = (),
) -> list[list[str]]:
    """The buckets for the agreed ``order`` of bucketable names (``params`` maps every name
    to its parameter): the ungrouped ones split by :func:`plan_buckets` (with ``breaks``),
    then each of the
    user's ``groups`` whose members are all bucketable and share a dtype and device as a
    bucket of its own. The other groups stay grouped allreduces."""
    allowed = set(order)
    grouped: set[str] = set()
    group_buckets = []
    for group in groups:
        members = [names[p] for p in group]
        grouped.update(members)
        if all(name in allowed for name in members) and len(
            {(p.dtype, p.device) for p in group}
        ) == 1:
            group_buckets.append(members)
    free = [name for name in order if name not in grouped]
    keys = {name: (params[name].dtype, params[name].device) for name in free}
    sizes = {name: params[name].numel() * params[name].element_size() for name in free}
    return plan_buckets(free, keys, sizes, threshold, breaks) + group_buckets
