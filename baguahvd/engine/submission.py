"""What a user thread works out about a collective before it hands it to the engine thread.

:meth:`~baguahvd.engine.engine.Engine.submit` describes a call once, with the helpers here,
and then queues it (:mod:`~baguahvd.engine.intake`) or, for a set of one rank, runs it:

- its name (:meth:`Submissions.name`): named requests by ``label.name``, unnamed ones by
  their order per process set, ``noname.N``; with ``BAGUAHVD_CHECK_CALL_SITES`` an unnamed
  request also records where the user called it (:func:`call_site`), so that rank 0 can tell
  ranks that pair unnamed collectives from different lines;
- what the ranks compare about its tensors (:func:`describe_tensors`);
- for CUDA tensors (and joins), where the submission stands in the submitter's CUDA stream
  (:meth:`Submissions.mark`): a :class:`~baguahvd.backends.cuda_support.StreamMark` kept in
  the request's progress, and the device this rank submits from, which the dispatcher later
  reads (where the zeros of a member that joined go). Only the submitting thread knows its
  current stream, so this is noted here, once, and only read afterwards.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Iterator, Sequence

import torch

from baguahvd.backends import cuda_support
from baguahvd.common.exceptions import CudaGraphCaptureError
from baguahvd.engine.messages import (
    DTYPE_NAMES,
    JOIN_KEY,
    UNNAMED_PREFIX,
    OpType,
    dtype_name,
    is_unnamed,
    unnamed_number,
)
from baguahvd.engine.requests import Request

_JOIN = OpType.JOIN  # a member looked up on its class costs as much as a dict lookup

# Frames in these folders are the library's, not the user's call.
_LIBRARY_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def call_site() -> str:
    """``file:line`` of the innermost frame outside baguahvd and torch: the user's call."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARY_DIRS):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


ONE_SHAPE: dict[torch.Size, tuple[tuple[int, ...], ...]] = {}
"""The ``shapes`` of a request of one tensor, by the tensor's size, for the sizes seen
lately (:func:`one_shape`): a training loop's requests share these tuples instead of each
making two, which also spares the garbage collector two objects per request in flight."""

_ONE_SHAPE_MAX = 4096


def one_shape(size: torch.Size) -> tuple[tuple[int, ...], ...]:
    """``(tuple(size),)``, kept in :data:`ONE_SHAPE` (emptied once it holds
    ``_ONE_SHAPE_MAX`` sizes, for a job whose shapes keep changing)."""
    shapes = (tuple(size),)
    if len(ONE_SHAPE) >= _ONE_SHAPE_MAX:
        ONE_SHAPE.clear()
    ONE_SHAPE[size] = shapes
    return shapes


def describe_tensors(
    inputs: Sequence[torch.Tensor], label: str
) -> tuple[str, tuple[tuple[int, ...], ...], str]:
    """The dtype name, the shapes and the device kind (``CPU`` or ``GPU``) of a call's
    tensors, as the ranks compare them.

    Raises:
        CudaGraphCaptureError: CUDA tensors were submitted while this thread's current
            stream captures a CUDA graph; refused before the call is named, so that the
            placeholder of the failed call takes the name the call would have had.
    """
    if not inputs:
        return "", (), "CPU"
    first = inputs[0]
    # The kind only, as Horovod compares it: each rank drives its own GPU (usually
    # cuda:<local_rank>), so indices differ across ranks of one collective.
    if first.is_cuda:
        device = "GPU"
        if cuda_support.stream_capturing():
            raise CudaGraphCaptureError(label)
    else:
        device = "CPU"
    dtype = DTYPE_NAMES.get(first.dtype) or dtype_name(first.dtype)
    if len(inputs) == 1:
        return dtype, ONE_SHAPE.get(first.shape) or one_shape(first.shape), device
    return dtype, tuple(tuple(t.shape) for t in inputs), device


class ThreadActivity(threading.local):
    """Per submitting thread: the timeline activity tagging the requests it submits now (a
    class default: looking up a thread-local's missing attribute raises and catches)."""

    name: str | None = None


class Submissions:
    """This rank's count of unnamed requests per process set, and the CUDA device its user
    threads submit from (see module docstring).

    Args:
        check_sites: record the call site of each unnamed request
            (BAGUAHVD_CHECK_CALL_SITES).
    """

    def __init__(self, check_sites: bool = False) -> None:
        self.check_sites = check_sites
        self._lock = threading.Lock()
        self._numbers: dict[int, Iterator[int]] = {}
        """Per process set, the numbers of its unnamed requests (``next()`` hands each out
        once, whatever the threads: one C call, without a lock)."""
        self._floors: dict[int, int] = {}
        """Per process set, the lowest number its next unnamed request may take, where
        :meth:`skip_unnamed` has counted collectives this rank submitted nothing for."""
        self.user_device: torch.device | None = None
        """The CUDA device of this rank's submissions (where its joined zeros go): the one
        the latest stream mark names, else the current device of the first thread that
        joined."""

    def name(
        self, op: OpType, label: str, process_set_id: int, name: str | None
    ) -> tuple[str, str, str]:
        """The negotiation key, the displayed name and the call site (for unnamed requests
        with BAGUAHVD_CHECK_CALL_SITES, else empty) of a call (see module docstring)."""
        if name is not None and op != _JOIN:
            key = f"{label}.{name}"
            return key, key, ""
        if op == _JOIN:
            return JOIN_KEY, JOIN_KEY, ""
        site = call_site() if self.check_sites else ""
        numbers = self._numbers.get(process_set_id)
        if numbers is None:
            with self._lock:
                numbers = self._numbers.setdefault(process_set_id, itertools.count())
        number = next(numbers)
        floor = self._floors.get(process_set_id)
        if floor is not None and number < floor:
            number = self._past_floor(process_set_id, numbers, number)
        key = f"{UNNAMED_PREFIX}{number}"
        return key, f"{label}.{key}", site

    def _past_floor(self, process_set_id: int, numbers: Iterator[int], number: int) -> int:
        """The first number from ``numbers`` at or past the set's floor, ``number`` being
        the one just taken (those below were skipped: no request of this rank takes them)."""
        while number < self._floors[process_set_id]:
            number = next(numbers)
        return number

    def skip_unnamed(self, process_set_id: int, key: str) -> None:
        """Counts an agreed unnamed collective this rank submitted nothing for.

        A rank that has joined takes part in the others' collectives without submitting
        them; its count of unnamed requests must still advance past each one, or its next
        unnamed request after the join would pair with one the others already ran (or
        failed). Named keys are ignored.
        """
        if not is_unnamed(key):
            return
        number = unnamed_number(key)
        with self._lock:  # floors only rise
            if self._floors.get(process_set_id, 0) <= number:
                self._floors[process_set_id] = number + 1

    def mark(self, request: Request) -> None:
        """Notes where a submission of CUDA tensors (or a join) stands in its submitter's
        CUDA stream, in ``request.mark``, and the device it was submitted from (on the
        submitting thread, before the request is queued)."""
        meta = request.meta
        if meta.device == "CPU" and meta.op != _JOIN:
            return
        mark = cuda_support.mark_submission(request.inputs)
        request.mark = mark
        if mark is not None:
            self.user_device = mark.device
        elif meta.op == _JOIN and self.user_device is None:
            self.user_device = cuda_support.thread_cuda_device()
