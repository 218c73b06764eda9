"""Reliability and observability parts that need no MPI: the log lines."""

from __future__ import annotations

import logging

import pytest

from baguahvd.common.logging_setup import TRACE, _RankFormatter, configure

# ---------------------------------------------------------------------------------------
# Logging


def _record(level: int, message: str = "hello") -> logging.LogRecord:
    record = logging.LogRecord("baguahvd.engine", level, "/x/stall.py", 42, message, None,
                               None)
    record.module = "stall"
    record.created = 1_700_000_000.123456
    return record


def test_log_lines_have_horovods_shape_with_the_rank() -> None:
    line = _RankFormatter(rank=3, hide_time=False).format(_record(logging.WARNING))
    assert line.endswith(".123456: W rank 3 stall.py:42] hello")
    assert line.startswith("[20")
    hidden = _RankFormatter(rank=3, hide_time=True).format(_record(logging.WARNING))
    assert hidden == "[W rank 3 stall.py:42] hello"
    letters = [_RankFormatter(0, True).format(_record(level))[1]
               for level in (TRACE, logging.DEBUG, logging.INFO, logging.WARNING,
                             logging.ERROR, logging.CRITICAL)]
    assert letters == ["T", "D", "I", "W", "E", "F"]


@pytest.mark.parametrize(("level", "expected"), [
    ("trace", TRACE), ("debug", logging.DEBUG), ("info", logging.INFO),
    ("warning", logging.WARNING), ("error", logging.ERROR), ("fatal", logging.CRITICAL),
])
def test_log_level_names(level: str, expected: int) -> None:
    logger = logging.getLogger("baguahvd")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    try:
        configure(rank=0, level=level, hide_time=True)
        assert logger.level == expected
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]
