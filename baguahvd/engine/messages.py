"""What ranks tell each other about their requests, and what they agree to run.

A :class:`RequestMeta` describes one submitted collective (no tensor data). Rank 0 collects
them and, once every member of the process set has submitted a name, checks that they agree
and turns them into one :class:`Response` that all ranks execute in the same order: the
description they agreed on (the first member's ``RequestMeta``, carried as it is) and what
rank 0 adds to it (every member's first dimensions or splits, the joined ranks, an error).

A request may be a placeholder: the collective failed its local checks on its rank, which
raised the error at once and still submitted the request (no tensors, ``failure`` set), so
that the other ranks' matching collective fails with that reason instead of pairing with the
rank's next one. Any placeholder among the requests makes the response an error, checked
before anything else; so does a disagreement of call sites (``site``, recorded for unnamed
requests when ``BAGUAHVD_CHECK_CALL_SITES`` is set).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from baguahvd.common.ops import ReduceOp


class OpType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PROCESS_SET = 7
    REMOVE_PROCESS_SET = 8

    @property
    def label(self) -> str:
        """Horovod's spelling in messages: ``ALLREDUCE``."""
        return self.name


JOIN_KEY = "join"
"""The negotiation key of every join request."""

GLOBAL_PROCESS_SET_ID = 0
"""The id of the process set of every rank."""

DATA_OPS = frozenset(
    {OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST, OpType.ALLTOALL, OpType.REDUCESCATTER}
)
"""The collectives that move tensors: Horovod prefixes their names with the op (e.g.
``allreduce.weights``), and only they may be cached."""
# First dimension may differ across ranks.
RAGGED_OPS = frozenset({OpType.ALLGATHER, OpType.ALLTOALL})

UNNAMED_PREFIX = "noname."
"""Negotiation keys of unnamed requests start with this (``noname.N``: the N-th unnamed
request of its process set on each rank)."""


def is_unnamed(key: str) -> bool:
    return key.startswith(UNNAMED_PREFIX)


def unnamed_number(key: str) -> int:
    """``N`` of an unnamed request's key ``noname.N``."""
    return int(key[len(UNNAMED_PREFIX):])


def dtype_name(dtype: torch.dtype) -> str:
    """How requests and responses name a dtype: ``float32``."""
    return str(dtype).replace("torch.", "")


DTYPES: dict[str, torch.dtype] = {
    dtype_name(dtype): dtype
    for dtype in (
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.bool,
    )
}
"""The dtypes a collective may carry, by the name requests and responses give them."""
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
""":data:`DTYPES` the other way round: :func:`dtype_name` without building a string."""


class RequestMeta(NamedTuple):
    """One rank's description of a submitted collective."""

    key: str
    """Negotiation key within the process set."""
    name: str
    """Name shown in messages, e.g. ``allreduce.fc1.weight``."""
    op: OpType
    process_set_id: int
    rank: int
    """Global rank of the submitter."""
    dtype: str = ""
    shapes: tuple[tuple[int, ...], ...] = ()
    device: str = "CPU"
    reduce_op: ReduceOp = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    """Broadcast root, as a rank of the process set."""
    splits: tuple[int, ...] | None = None
    """Alltoall: elements of dim 0 sent to each member."""
    payload: tuple[int, ...] = ()
    """Op-specific integers (the ranks of a process set being added or removed)."""
    failure: str = ""
    """A placeholder's reason (``Type: message``): the collective failed its local checks on
    this rank. Never empty in a request that carries tensors, so a placeholder never matches
    a cached signature: it invalidates the entry of its name instead of hitting it."""
    site: str = ""
    """``file:line`` of the user's call, for unnamed requests with BAGUAHVD_CHECK_CALL_SITES."""
    fuse: bool = True
    """Allreduce: whether it may share a fusion buffer with others; False runs it alone, in
    place on its own tensors."""

    def signature(self) -> tuple[object, ...]:
        """Everything that must match for a cached response to be reused by this rank: the
        request itself, since on one rank the cache key fixes the name, the process set and
        the rank (comparing two requests costs less than building a tuple of the rest)."""
        return self


class Response(NamedTuple):
    """A collective every member of the process set runs, or an error they all raise: the
    description they agreed on (the first member's request: its op, dtype, shapes, scaling,
    root...), and what rank 0 adds to it."""

    meta: RequestMeta
    """What the members agreed to run; for an error, only its name, op and process set."""
    first_dims: tuple[tuple[int, ...], ...] = ()
    """Allgather: per tensor, every member's dim 0 (member order)."""
    splits: tuple[tuple[int, ...], ...] = ()
    """Alltoall: every member's splits (member order)."""
    error: str | None = None
    joined: tuple[int, ...] = ()
    """Members that have called join() and take part with zeros."""
    last_joined: int = -1


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _describe_local_failures(metas: Sequence[RequestMeta]) -> str | None:
    """Names every rank whose request is a placeholder, with its reason, or returns None."""
    failed = [meta for meta in metas if meta.failure]
    if not failed:
        return None
    reasons = "; ".join(
        f"rank {meta.rank} failed its local checks: {meta.failure}" for meta in failed
    )
    return f"{metas[0].name}: {reasons}"


def _describe_site_mismatch(metas: Sequence[RequestMeta]) -> str | None:
    """Names the first two ranks that submitted an unnamed collective from different call
    sites, or returns None (requests without a site are not compared)."""
    placed = [meta for meta in metas if meta.site]
    for meta in placed[1:]:
        if meta.site != placed[0].site:
            return (
                f"{placed[0].name}: ranks paired unnamed collectives from different call "
                f"sites: rank {placed[0].rank} called {placed[0].name} at {placed[0].site}, "
                f"but rank {meta.rank} called {meta.name} at {meta.site}. Unnamed "
                "collectives pair by their order on each rank: give them names, or make "
                "every rank call them in the same order."
            )
    return None


def _first_different(
    metas: Sequence[RequestMeta], value: Callable[[RequestMeta], object]
) -> RequestMeta | None:
    """The first request whose ``value`` differs from the first request's, or None."""
    reference = value(metas[0])
    return next((meta for meta in metas[1:] if value(meta) != reference), None)


def _describe_shape_mismatch(first: RequestMeta, meta: RequestMeta, index: int) -> str | None:
    """Whether tensor ``index`` of ``meta``'s group disagrees with ``first``'s: in all of its
    shape, or for ragged collectives in any dimension but the first."""
    reference, shape = first.shapes[index], meta.shapes[index]
    member = "" if len(first.shapes) == 1 else f" (tensor {index} of the group)"
    prefix = (f"Mismatched {first.op.label} tensor shapes for {first.name}{member}: rank "
              f"{first.rank} sent")
    if first.op not in RAGGED_OPS:
        if shape == reference:
            return None
        return (f"{prefix} a tensor of shape {_shape(reference)}, but rank {meta.rank} sent a "
                f"tensor of shape {_shape(shape)}.")
    if len(shape) != len(reference):
        return (f"{prefix} a tensor of rank {len(reference)}, but rank {meta.rank} sent a "
                f"tensor of rank {len(shape)}.")
    dim = next((d for d in range(1, len(shape)) if shape[d] != reference[d]), None)
    if dim is None:
        return None
    return (f"{prefix} a tensor with dimension {dim} equal to {reference[dim]}, but rank "
            f"{meta.rank} sent a tensor with dimension {dim} equal to {shape[dim]}.")


class _Rule(NamedTuple):
    """A field the members must agree on, and how a disagreement on it is told: "Mismatched
    {subject} for {name}: rank {a} {verb} {shown(a)}, but rank {b} {verb} {shown(b)}."."""

    subject: str
    """What disagrees; ``{label}`` stands for the op (``ALLREDUCE``)."""
    verb: str
    value: Callable[[RequestMeta], object]
    shown: Callable[[RequestMeta, Sequence[int]], str]
    """A member's value as the message shows it, given the process set's global ranks."""


# Horovod's order of the checks: these before the shapes, ...
_RULES_BEFORE_SHAPES = (
    _Rule("operations", "did", lambda m: m.op, lambda m, _: f"an {m.op.label}"),
    _Rule("data types", "had", lambda m: m.dtype, lambda m, _: f"type {m.dtype}"),
)
# ... these after them.
_RULES_AFTER_SHAPES = (
    _Rule("reduction operation", "sent", lambda m: m.reduce_op,
          lambda m, _: f"reduction op {int(m.reduce_op)} ({m.reduce_op.name})"),
    _Rule("prescale and/or postscale factors", "sent", lambda m: (m.prescale, m.postscale),
          lambda m, _: f"factors ({m.prescale}, {m.postscale})"),
    _Rule("{label} root ranks", "specified", lambda m: m.root,
          lambda m, ranks: f"root rank {ranks[m.root]}"),
    _Rule("{label} CPU/GPU device selection", "specified", lambda m: m.device,
          lambda m, _: f"device {m.device}"),
    _Rule("{label} arguments", "sent", lambda m: m.payload, lambda m, _: f"{list(m.payload)}"),
    _Rule("{label} fusion", "sent", lambda m: m.fuse, lambda m, _: f"fuse={m.fuse}"),
)


def _describe_rule_mismatch(
    rules: Sequence[_Rule], metas: Sequence[RequestMeta], ranks: Sequence[int]
) -> str | None:
    """The message of the first of ``rules`` the members disagree on, or None."""
    first = metas[0]
    for rule in rules:
        if other := _first_different(metas, rule.value):
            subject = rule.subject.format(label=first.op.label)
            return (f"Mismatched {subject} for {first.name}: rank {first.rank} {rule.verb} "
                    f"{rule.shown(first, ranks)}, but rank {other.rank} {rule.verb} "
                    f"{rule.shown(other, ranks)}.")
    return None


def _describe_shapes_mismatch(metas: Sequence[RequestMeta]) -> str | None:
    """The first disagreement on the number of tensors or on a tensor's shape, or a
    rank-zero tensor of a ragged collective; None when the shapes agree."""
    first = metas[0]
    label, name = first.op.label, first.name
    if other := _first_different(metas, lambda m: len(m.shapes)):
        return (f"Mismatched {label} group sizes for {name}: rank {first.rank} sent "
                f"{len(first.shapes)} tensors, but rank {other.rank} sent {len(other.shapes)}.")
    for index, reference in enumerate(first.shapes):
        for meta in metas[1:]:
            if shape_error := _describe_shape_mismatch(first, meta, index):
                return shape_error
        if first.op in RAGGED_OPS and len(reference) == 0:
            return f"Process-set rank zero tried to {label} a rank-zero tensor ({name})."
    return None


def _describe_first_mismatch(
    metas: Sequence[RequestMeta], ranks: Sequence[int]
) -> str | None:
    """Returns a message naming the ranks and values of the first disagreement, or None.
    The fields are compared in Horovod's order, each across all ranks before the next."""
    return (
        _describe_rule_mismatch(_RULES_BEFORE_SHAPES, metas, ranks)
        or _describe_shapes_mismatch(metas)
        or _describe_rule_mismatch(_RULES_AFTER_SHAPES, metas, ranks)
    )


_RANK = RequestMeta._fields.index("rank")
_AFTER_RANK = _RANK + 1


def without_rank(meta: RequestMeta) -> tuple[object, ...]:
    """Everything ``meta`` says but the submitter's rank: requests equal in it differ only
    in who sent them."""
    return meta[:_RANK] + meta[_AFTER_RANK:]


def passes_alone(meta: RequestMeta) -> bool:
    """Whether requests that equal ``meta`` in everything but the rank pass every check of
    :func:`build_response`, whose response is then ``build_response([meta], ...)``, ``meta``
    being the first member's request. Not for placeholders, nor for the ragged collectives,
    whose rank-zero tensors are refused even when every member sends one and whose response
    lists every member's first dimensions or splits."""
    return not meta.failure and meta.op not in RAGGED_OPS


def _alike(metas: Sequence[RequestMeta]) -> bool:
    """Whether the members' requests agree in everything but the rank, and so pass every
    check: the common case, decided with one tuple comparison per member instead of the
    checks' field-by-field walk. Placeholders and the ragged collectives take the full
    checks (:func:`passes_alone`)."""
    first = metas[0]
    if not passes_alone(first):
        return False
    op, rest = first.op, first[_AFTER_RANK:]
    return all(meta.op is op and meta[_AFTER_RANK:] == rest for meta in metas[1:])


_JOIN_UNSUPPORTED = {
    OpType.ALLGATHER: "Allgather is not supported with Join at this time. Specify "
    "sparse_to_dense=True if using DistributedOptimizer",
    OpType.BROADCAST: "Broadcast is not supported with Join at this time.",
    OpType.ALLTOALL: "Alltoall is not supported with Join at this time.",
    OpType.REDUCESCATTER: "Reducescatter is not supported with Join at this time.",
}


def build_response(
    metas: Sequence[RequestMeta], ranks: Sequence[int], joined: Sequence[int]
) -> Response:
    """Agrees on one response from the members' requests (given in member order).

    Args:
        metas: the requests of the members that submitted (all of them unless some joined).
        ranks: the process set's global ranks.
        joined: global ranks of members that joined and take part without a request.
    """
    first = metas[0]
    error = None if _alike(metas) else (
        _describe_local_failures(metas)
        or _describe_site_mismatch(metas)
        or _describe_first_mismatch(metas, ranks)
    )
    if error is None and joined and first.op in _JOIN_UNSUPPORTED:
        error = f"{_JOIN_UNSUPPORTED[first.op]} ({first.name}; joined ranks: {list(joined)})"
    if error is not None:
        named = RequestMeta(first.key, first.name, first.op, first.process_set_id, first.rank)
        return Response(named, error=error)
    first_dims: tuple[tuple[int, ...], ...] = ()
    if first.op == OpType.ALLGATHER:
        first_dims = tuple(
            tuple(meta.shapes[i][0] for meta in metas) for i in range(len(first.shapes))
        )
    splits: tuple[tuple[int, ...], ...] = ()
    if first.op == OpType.ALLTOALL:
        splits = tuple(meta.splits or () for meta in metas)
    return Response(first, first_dims, splits, None, tuple(joined))
