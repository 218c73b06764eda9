"""``hvd.elastic.run``: the retry loop around a training function."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from baguahvd.runtime.runtime import runtime
from baguahvd.torch.elastic import rounds
from baguahvd.torch.elastic.base import run_fn

_Result = TypeVar("_Result")


def _reset() -> None:
    if rounds.in_process():
        rounds.rejoin(runtime.shutdown, runtime.init)
        return
    runtime.shutdown()
    runtime.init()


def run(func: Callable[..., _Result]) -> Callable[..., _Result]:
    """Decorates ``func(state, *args, **kwargs)`` for elastic training.

    The wrapper resumes from the newest commit persisted by an earlier launch of the job
    (under ``baguahvdrun --elastic``), syncs ``state`` from rank 0 and calls ``func``; see
    :func:`baguahvd.torch.elastic.base.run_fn` for what happens on failures and host changes.

    Args:
        func: the training function; its first argument is a ``TorchState``.

    Returns:
        The wrapped function, called as ``func(state, *args, **kwargs)``.
    """
    return run_fn(func, _reset)


__all__ = ["run"]
