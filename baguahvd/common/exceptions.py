"""Exceptions raised by baguahvd.

Each one subclasses what Horovod raises in the same situation, so ``except`` clauses written
for Horovod keep working.
"""

from __future__ import annotations

NOT_INITIALIZED_MESSAGE = "Horovod has not been initialized; use hvd.init()."

SHUT_DOWN_MESSAGE = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an "
    "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in "
    "the log before the first shutdown message."
)

DUPLICATE_NAME_MESSAGE = (
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
    "tensor that is currently being processed.  If you want to request another tensor, use a "
    "different tensor name."
)


class HorovodInternalError(RuntimeError):
    """A collective failed; raised from ``synchronize()`` and the blocking collectives."""


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed during elastic training.

    Args:
        skip_sync: whether the state may skip its next ``sync()``.
    """

    def __init__(self, skip_sync: bool) -> None:
        super().__init__()
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError):
    """The installed framework does not match the one baguahvd supports."""


class NotInitializedError(ValueError):
    """The API was used before ``hvd.init()``."""

    def __init__(self, message: str = NOT_INITIALIZED_MESSAGE) -> None:
        super().__init__(message)


class CollectiveNotInitializedError(HorovodInternalError, NotInitializedError):
    """A collective was submitted before ``hvd.init()``.

    Horovod raises ``HorovodInternalError`` from collectives and ``ValueError`` from the
    topology queries; this class is both, so either ``except`` clause catches it.
    """

    def __init__(self, message: str = NOT_INITIALIZED_MESSAGE) -> None:
        # RuntimeError precedes NotInitializedError in the MRO, so its __init__ (which has
        # no default message) would otherwise be the one called.
        super().__init__(message)


class ShutDownError(HorovodInternalError):
    """The engine has stopped: this rank or a peer called ``shutdown()``."""

    def __init__(self, reason: str | None = None) -> None:
        message = SHUT_DOWN_MESSAGE if reason is None else f"{SHUT_DOWN_MESSAGE} ({reason})"
        super().__init__(message)


class PeerFailureError(ShutDownError):
    """A rank failed: it raised an exception, died, or its engine broke down.

    Raised on every other rank from the collectives that were pending and from later ones.

    Attributes:
        rank: the first rank that failed (-1 when the failing rank is not known, e.g. when
            peers stopped answering).
        reason: that rank's exception as ``Type: message``, or what was observed.
    """

    def __init__(self, rank: int, reason: str) -> None:
        who = f"rank {rank}" if rank >= 0 else "a rank"
        HorovodInternalError.__init__(self, f"{who} failed: {reason}\n{SHUT_DOWN_MESSAGE}")
        self.rank = rank
        self.reason = reason


class StallError(ShutDownError):
    """Some ranks waited on collectives that others never submitted for longer than
    ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``; raised on every rank.

    Attributes:
        missing: tensor name -> the ranks that had not submitted it.
    """

    def __init__(self, report: str, missing: dict[str, list[int]]) -> None:
        HorovodInternalError.__init__(self, f"{report}\n{SHUT_DOWN_MESSAGE}")
        self.report = report
        self.missing = missing


class MismatchError(HorovodInternalError):
    """Ranks submitted incompatible requests under one name; raised on every rank involved."""


class DuplicateNameError(ValueError):
    """A name was submitted while a request of the same name is still in flight on this rank."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{DUPLICATE_NAME_MESSAGE} (name: {name})")
        self.name = name


class ProcessSetError(ValueError):
    """A process set was used by a non-member, or was never registered."""


class CudaGraphCaptureError(ValueError):
    """A collective was submitted while the submitting thread's current CUDA stream was
    capturing a CUDA graph (``torch.cuda.graph``, ``make_graphed_callables``).

    Collectives are negotiated with the other ranks and launched by the engine thread, so a
    graph cannot replay them; the call is refused on this rank (and its peers' matching
    collective fails with this reason) instead of being queued.
    """

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what}: collectives cannot be captured in a CUDA graph, and this thread's "
            "current CUDA stream is capturing one. Call baguahvd collectives outside the "
            "captured region (for example, allreduce the gradients after replaying the "
            "graph, before the optimizer step)."
        )
