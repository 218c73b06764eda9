"""``horovod.torch`` for unmodified Horovod scripts: everything comes from ``baguahvd.torch``.

Names not exported by ``baguahvd.torch`` (private helpers, submodules such as ``mpi_ops`` or
``elastic``) are looked up on first access, so ``hvd.mpi_ops`` and
``from horovod.torch.elastic import TorchState`` give baguahvd's objects.
"""

import importlib as _importlib
from typing import Any as _Any

import baguahvd.torch as _baguahvd_torch
from baguahvd.torch import *  # noqa: F403


def _has_gpu() -> bool:
    """Horovod's probe used by ``horovod.common.util.gpu_available('torch')``."""
    import torch

    return torch.cuda.is_available()


def _check_extension(*args: _Any, **kwargs: _Any) -> None:
    """Horovod checks that its compiled extension loads; baguahvd has none to check."""


# Used only where baguahvd.torch does not define the name itself.
_FALLBACKS: dict[str, _Any] = {
    "_check_has_gpu": _has_gpu,
    "check_extension": _check_extension,
    "_MPI_LIB_AVAILABLE": True,
}


def __getattr__(name: str) -> _Any:
    """Resolves names missing here: baguahvd.torch's, then fallbacks, then submodules."""
    try:
        return getattr(_baguahvd_torch, name)
    except AttributeError:
        pass
    if name in _FALLBACKS:
        return _FALLBACKS[name]
    if not name.startswith("__"):
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
