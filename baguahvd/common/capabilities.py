"""What this installation of baguahvd can do: Horovod's ``*_built()`` queries.

Horovod answers these from compile-time flags. baguahvd has nothing compiled, so the answers
describe what the Python environment provides: MPI through mpi4py, Gloo through
torch.distributed, NCCL and CUDA through CuPy, and never DDL, CCL or ROCm. Every query
works before ``hvd.init()`` and never raises.

Only ``baguahvd.backends`` may import ``mpi4py`` or ``cupy``. The probes here stay within that
rule: they look the packages up with :func:`importlib.util.find_spec`, which does not import
them. The one exception is the NCCL version (and the CUDA runtime check), which CuPy only
reports once imported; those two queries import ``cupy`` lazily, inside the function, guard
against any error it raises, and remember the answer, so the import is paid at most once and
only by callers that ask.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)


def _has_module(name: str) -> bool:
    """Tells whether ``name`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        # ValueError: the module is in sys.modules with no __spec__ (e.g. a test stub).
        return False


def mpi_built() -> bool:
    """Tells whether MPI is available, i.e. whether ``mpi4py`` is installed.

    Returns:
        ``True`` when ``mpi4py`` can be imported.
    """
    return _has_module("mpi4py")


def gloo_built() -> bool:
    """Tells whether Gloo is available, i.e. torch.distributed with its gloo backend.

    Once torch is imported this asks it; before (the launcher never imports torch), an
    installed torch counts, since every torch build for Linux and macOS ships gloo.

    Returns:
        ``True`` when the gloo backend of torch.distributed can be used.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return _has_module("torch")
    distributed = getattr(torch, "distributed", None)
    return bool(
        distributed is not None
        and distributed.is_available()
        and distributed.is_gloo_available()
    )


@functools.cache
def nccl_built() -> int:
    """Returns the NCCL version code CuPy was built with, e.g. ``21805`` for 2.18.5.

    The answer is computed once and cached.

    Returns:
        The version code, or ``0`` when CuPy or its NCCL bindings are missing or unusable.
    """
    if not _has_module("cupy"):
        return 0
    try:
        nccl = importlib.import_module("cupy.cuda.nccl")
        version = int(nccl.get_version())
    except Exception as error:  # CuPy raises many kinds of errors without a GPU stack.
        logger.debug("NCCL is not usable through CuPy: %s", error)
        return 0
    return max(version, 0)


@functools.cache
def cuda_built() -> bool:
    """Tells whether CUDA is available, i.e. CuPy imports and finds a CUDA runtime.

    A GPU is not required; use ``torch.cuda.is_available()`` for that. The answer is computed
    once and cached.

    Returns:
        ``True`` when CuPy reports a CUDA runtime version.
    """
    if not _has_module("cupy"):
        return False
    try:
        cupy = importlib.import_module("cupy")
        return int(cupy.cuda.runtime.runtimeGetVersion()) > 0
    except Exception as error:  # CuPy raises many kinds of errors without a GPU stack.
        logger.debug("CUDA is not usable through CuPy: %s", error)
        return False


def rocm_built() -> bool:
    """Tells whether ROCm is available. baguahvd does not support ROCm.

    Returns:
        Always ``False``.
    """
    return False


def ddl_built() -> bool:
    """Tells whether IBM DDL is available. baguahvd does not support DDL.

    Returns:
        Always ``False``.
    """
    return False


def ccl_built() -> bool:
    """Tells whether oneCCL is available. baguahvd does not support oneCCL.

    Returns:
        Always ``False``. (Horovod's test suite skips process-set tests when this is ``True``.)
    """
    return False
