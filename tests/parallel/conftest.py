"""Runs on every rank: initialise once, expose rank/size to the test bodies."""

from __future__ import annotations

import os

import pytest

# Read at init(), as Horovod's own suite does.
os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")

import baguahvd.torch as hvd  # noqa: E402


@pytest.fixture(autouse=True)
def _initialised() -> None:
    hvd.init()


@pytest.fixture
def rank() -> int:
    return hvd.rank()


@pytest.fixture
def size() -> int:
    return hvd.size()
