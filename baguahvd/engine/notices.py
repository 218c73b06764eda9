"""What ranks exchange each cycle besides requests: how a job ends, and why.

In a cycle where some rank has something to say, every rank sends rank 0 a
:class:`RankReport` (its new requests, how long each has waited, and possibly a
:class:`Notice`; merged with the others' on the way, see
:mod:`baguahvd.engine.negotiation.tree`), and rank 0 answers everyone with one
:class:`Decision`. A notice is final: the cycle that carries one runs no
collective, and every rank stops with the error the notice describes. That is how a
rank's ``shutdown()``, its uncaught exception, its broken engine and rank 0's stall
inspector reach every other rank, with the first failing rank and its reason in the error.
"""

from __future__ import annotations

import enum
import traceback
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import NamedTuple

from baguahvd.common.exceptions import PeerFailureError, ShutDownError, StallError
from baguahvd.engine.autotune import Settings
from baguahvd.engine.messages import RequestMeta, Response

# Reasons travel in every rank's report; a traceback's worth is plenty.
_MAX_REASON_CHARS = 2000


class NoticeKind(enum.IntEnum):
    """Why a rank ends the job, in increasing order of precedence."""

    SHUTDOWN = 0
    """The rank called ``shutdown()`` (also at the end of its script)."""
    STALL = 1
    """Rank 0's stall inspector: collectives waited past the shutdown time."""
    FAILURE = 2
    """The rank raised an exception it did not handle, or its engine broke."""


class Notice(NamedTuple):
    """One rank's announcement that the job ends."""

    kind: NoticeKind
    rank: int
    """Global rank that sends it."""
    text: str = ""
    """The exception (``Type: message``) or the stall report."""
    missing: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Stalls: each stalled collective's name and the ranks that had not submitted it."""

    def error(self, own_rank: int) -> ShutDownError:
        """The error every pending and later collective of ``own_rank`` raises."""
        if self.kind == NoticeKind.FAILURE:
            return PeerFailureError(self.rank, self.text)
        if self.kind == NoticeKind.STALL:
            return StallError(self.text, {name: list(ranks) for name, ranks in self.missing})
        if self.rank == own_rank:
            return ShutDownError()
        return ShutDownError(f"rank {self.rank} shut down")

    @property
    def abnormal(self) -> bool:
        """Whether the job ends because something went wrong."""
        return self.kind != NoticeKind.SHUTDOWN


def first_notice(notices: Iterable[Notice | None]) -> Notice | None:
    """The notice that names the job's end when several ranks send one in the same
    cycle: failures before stalls before shutdowns, then the lowest rank."""
    present = [n for n in notices if n is not None]
    if not present:
        return None
    return min(present, key=lambda n: (-int(n.kind), n.rank))


class RankReport(NamedTuple):
    """What one rank tells rank 0 in a cycle."""

    metas: list[RequestMeta]
    waited: list[float]
    """Seconds each request of ``metas`` had waited on this rank before it was sent (more
    than a cycle for requests that waited on a cached response)."""
    notice: Notice | None = None


class Decision(NamedTuple):
    """What rank 0 sends every rank in a cycle."""

    responses: list[Response]
    joined: tuple[int, ...]
    notice: Notice | None = None
    settings: Settings | None = None
    """Autotune: settings every rank switches to when this cycle ends."""


def describe_exception(
    exc: BaseException, tb: TracebackType | None = None
) -> str:
    """``Type: message (at file:line in function)``: how a failure is named to the other
    ranks."""
    name = type(exc).__name__
    message = str(exc)
    text = f"{name}: {message}" if message else name
    frames: Sequence[traceback.FrameSummary] = traceback.extract_tb(
        tb if tb is not None else exc.__traceback__
    )
    if frames:
        last = frames[-1]
        text = f"{text} (at {last.filename}:{last.lineno} in {last.name})"
    if len(text) > _MAX_REASON_CHARS:
        text = text[: _MAX_REASON_CHARS - 3] + "..."
    return text
