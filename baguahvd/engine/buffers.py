"""Fusion buffers: the memory that fused allreduces copy their tensors into and out of.

:class:`FusionBuffers` keeps one flat buffer per dtype and device and the views of it that
recurring layouts use; :class:`FusionPool` hands a device communicator's units buffers of
their own; :class:`ByteCount` totals the bytes copied through them (``Engine.fusion_bytes``).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from baguahvd.backends import memory

# Fused layouts whose views are kept: a training step repeats a few of them.
_MAX_LAYOUTS = 32

Layout = tuple[torch.dtype, torch.device, tuple[tuple[int, ...], ...]]


class FusionBuffers:
    """One reusable flat buffer per dtype and device, grown on demand, and the views of it
    that recurring fused layouts copy their tensors in and out of.

    Creating a view costs as much as copying a few kilobytes, and a step fuses the same
    tensors in the same order every time (the response cache hands them out in slot order),
    so the views of each layout are made once.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._layouts: OrderedDict[Layout, tuple[torch.Tensor, list[torch.Tensor]]] = (
            OrderedDict()
        )

    def get(
        self, dtype: torch.dtype, count: int, device: torch.device, host: bool = False
    ) -> torch.Tensor:
        """The buffer of ``dtype`` on ``device``, at least ``count`` long; ``host``: a CPU
        buffer, allocated on huge pages whatever its size (see
        :func:`~baguahvd.backends.memory.empty_huge`): a burst of small tensors fills a
        buffer of a megabyte or so, which Open MPI reduces in about 0.6 of the time it
        takes on 4 KB pages (``benchmarks/README.md``, "Huge pages for reused buffers")."""
        buffer = self._buffers.get((dtype, device))
        if buffer is None or buffer.numel() < count:
            # A normal tensor even when the first fused unit runs in inference mode: an
            # inference tensor could not be written by the later units that do not.
            with torch.inference_mode(False):
                buffer = (
                    memory.empty_huge(count, dtype, min_bytes=0)
                    if host
                    else torch.empty(count, dtype=dtype, device=device)
                )
            self._buffers[(dtype, device)] = buffer
            # Views of the old buffer would keep it alive.
            for layout in [k for k in self._layouts if k[0] == dtype and k[1] == device]:
                del self._layouts[layout]
        return buffer[:count]

    def views(
        self, dtype: torch.dtype, device: torch.device, shapes: tuple[tuple[int, ...], ...],
        host: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The flat buffer for tensors of ``shapes`` (in order), and a view of it shaped as
        each tensor; ``host`` as for :meth:`get`."""
        layout = (dtype, device, shapes)
        found = self._layouts.get(layout)
        if found is not None:
            self._layouts.move_to_end(layout)
            return found
        counts = [math.prod(shape) for shape in shapes]
        buffer = self.get(dtype, sum(counts), device, host)
        # split() makes the flat views in one call; only the others need a second view.
        views = [
            part if len(shape) == 1 else part.view(shape)
            for part, shape in zip(buffer.split(counts), shapes)
        ]
        self._layouts[layout] = (buffer, views)
        if len(self._layouts) > _MAX_LAYOUTS:
            self._layouts.popitem(last=False)
        return buffer, views


class ByteCount:
    """A running total of bytes that several threads add to (the engine thread and the
    user threads that run single-member sets' collectives)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.value += nbytes


class FusionPool:
    """The fusion buffers of one device communicator's units, one :class:`FusionBuffers` per
    unit in flight.

    A fused device unit keeps its buffers from its launch until the copy out of them is
    queued, which waits until the host has seen the unit's communication finish (see
    :func:`allreduce`'s ``split``); units launched meanwhile take other buffers. All of them
    are used on the communicator's stream only, in the order that stream runs them, so a
    buffer given back is ready for the next unit queued there, and one dropped (grown, or
    beyond the few that are kept) goes back to the allocator of that stream, which orders
    its reuse after its last use.
    """

    _KEEP = 2
    """Buffers kept for reuse; more are in flight only while the device lags behind."""

    def __init__(self) -> None:
        self._free: list[FusionBuffers] = []

    def take(self) -> FusionBuffers:
        """Buffers no unit in flight uses (any thread)."""
        try:
            return self._free.pop()
        except IndexError:
            return FusionBuffers()

    def give_back(self, buffers: FusionBuffers) -> None:
        """Returns buffers once every use of them is queued on the communicator's stream."""
        if len(self._free) < self._KEEP:
            self._free.append(buffers)
