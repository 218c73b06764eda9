"""Log lines with the rank in them, honouring HOROVOD_LOG_LEVEL and HOROVOD_LOG_HIDE_TIME."""

from __future__ import annotations

import logging

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_LEVELS = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
}


class _RankFormatter(logging.Formatter):
    """Horovod's line shape, ``[time: L file:line] message``, with the rank added."""

    def __init__(self, rank: int, hide_time: bool) -> None:
        super().__init__()
        self.rank = rank
        self.hide_time = hide_time

    def format(self, record: logging.LogRecord) -> str:
        # Horovod's letters: T, D, I, W, E and F (fatal) for logging's CRITICAL.
        letter = "F" if record.levelno >= logging.CRITICAL else record.levelname[:1]
        where = f"{record.module}.py:{record.lineno}"
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if self.hide_time:
            return f"[{letter} rank {self.rank} {where}] {message}"
        stamp = self.formatTime(record, "%Y-%m-%d %H:%M:%S")
        micros = int(record.created % 1 * 1_000_000)
        return f"[{stamp}.{micros:06d}: {letter} rank {self.rank} {where}] {message}"


def configure(rank: int, level: str, hide_time: bool) -> None:
    """Points the ``baguahvd`` logger at stderr with a rank prefix (once per process)."""
    logger = logging.getLogger("baguahvd")
    logger.setLevel(_LEVELS[level])
    for handler in list(logger.handlers):
        if getattr(handler, "_baguahvd", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler()
    handler._baguahvd = True  # type: ignore[attr-defined]
    handler.setFormatter(_RankFormatter(rank, hide_time))
    logger.addHandler(handler)
    logger.propagate = False
