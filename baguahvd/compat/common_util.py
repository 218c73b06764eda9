"""Horovod's ``horovod.common.util`` helpers, for scripts that import them.

Under the import shim ``horovod.common.util`` is this module. Horovod's versions probe its
compiled extensions; baguahvd compiles none, so the extension checks accept PyTorch (the one
framework it serves) and refuse the others with Horovod's ``ImportError``, and the ``*_built``
queries answer from :mod:`baguahvd.common.capabilities`. The plain helpers (:func:`env`,
:func:`split_list`, :func:`num_rank_is_power_2`, ...) behave as Horovod's do.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from baguahvd.common import capabilities

T = TypeVar("T")

EXTENSIONS = ("torch",)
"""The frameworks this installation serves (Horovod lists tensorflow, torch and mxnet)."""


def _framework(ext_name: str) -> str:
    """``"horovod.torch"``, ``"torch"`` → ``"torch"``."""
    return ext_name.rsplit(".", 1)[-1]


def get_ext_suffix() -> str:
    """Returns the file suffix of compiled extension modules (e.g. ``.cpython-311-...so``)."""
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def get_extension_full_path(pkg_path: str, *args: str) -> str:
    """Returns where Horovod would keep the compiled extension ``args`` beside ``pkg_path``."""
    directory = os.path.dirname(os.path.abspath(pkg_path))
    return os.path.join(directory, *args[:-1], args[-1] + get_ext_suffix())


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: str) -> None:
    """Raises Horovod's ``ImportError`` unless ``ext_name`` is a framework baguahvd serves.

    Args:
        ext_name: e.g. ``"horovod.torch"``.
        ext_env_var: the build variable Horovod names in its message, e.g.
            ``"HOROVOD_WITH_PYTORCH"``.
        pkg_path: the calling module's ``__file__`` (unused: nothing is compiled).
        *args: the extension's module path (unused).
    """
    if _framework(ext_name) not in EXTENSIONS:
        raise ImportError(
            f"Extension {ext_name} has not been built: baguahvd provides horovod.torch only "
            f"({ext_env_var} has no effect here)."
        )


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether ``ext_base_name`` (``"torch"``, ``"tensorflow"``, ...) can be used."""
    return _framework(ext_base_name) in EXTENSIONS and _importable(_framework(ext_base_name))


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework ``ext_base_name`` sees a GPU (for torch: CUDA is available)."""
    if not extension_available(ext_base_name, verbose):
        return False
    framework = importlib.import_module(_framework(ext_base_name))
    return bool(framework.cuda.is_available())


def mpi_built(verbose: bool = False) -> bool:
    """Whether MPI is available (see :func:`baguahvd.common.capabilities.mpi_built`)."""
    return capabilities.mpi_built()


def gloo_built(verbose: bool = False) -> bool:
    """Whether Gloo is available (see :func:`baguahvd.common.capabilities.gloo_built`)."""
    return capabilities.gloo_built()


def nccl_built(verbose: bool = False) -> int:
    """The NCCL version code, or 0 (see :func:`baguahvd.common.capabilities.nccl_built`)."""
    return capabilities.nccl_built()


def ddl_built(verbose: bool = False) -> bool:
    """Always ``False``: there is no IBM DDL support."""
    return capabilities.ddl_built()


def ccl_built(verbose: bool = False) -> bool:
    """Always ``False``: there is no oneCCL support."""
    return capabilities.ccl_built()


def cuda_built(verbose: bool = False) -> bool:
    """Whether CUDA collectives are available (see ``capabilities.cuda_built``)."""
    return capabilities.cuda_built()


def rocm_built(verbose: bool = False) -> bool:
    """Always ``False``: there is no ROCm support."""
    return capabilities.rocm_built()


@contextlib.contextmanager
def env(**kwargs: Any) -> Iterator[None]:
    """Sets environment variables for the ``with`` block and restores them afterwards.

    ``None`` removes a variable; other values are set as ``str(value)``. A common use is
    ``with env(HOROVOD_STALL_CHECK_TIME_SECONDS="300"): hvd.init()``.
    """
    saved = {name: os.environ.get(name) for name in kwargs}
    try:
        for name, value in kwargs.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def get_average_backwards_compatibility_fun(
    reduce_ops: Any,
) -> Callable[[Any, bool | None], Any]:
    """Returns Horovod's resolver of the deprecated ``average=`` argument into an ``op``.

    Args:
        reduce_ops: an object with ``Average`` and ``Sum`` attributes (the module that
            defines the reduce operations).
    """

    def resolve(op: Any, average: bool | None) -> Any:
        if op is not None:
            if average is not None:
                raise ValueError(
                    "The op parameter supersedes average. Please provide only one of them."
                )
            return op
        if average is not None:
            warnings.warn(
                "Parameter `average` has been replaced with `op` and will be removed",
                DeprecationWarning,
                stacklevel=3,
            )
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return resolve


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a (positive) power of two, as Adasum needs."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def split_list(items: Sequence[T], n: int) -> list[Sequence[T]]:
    """Splits ``items`` into ``n`` consecutive parts whose lengths differ by at most one,
    the longer parts first."""
    size, extra = divmod(len(items), n)
    return [
        items[i * size + min(i, extra):(i + 1) * size + min(i + 1, extra)] for i in range(n)
    ]


def is_iterable(x: Any) -> bool:
    """Whether ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Compares two ``major.minor.patch`` version strings (extra suffixes are ignored).

    Raises:
        ValueError: either string does not start with three dot-separated numbers.
    """

    def parts(text: str) -> tuple[int, int, int]:
        match = re.match(r"^(\d+)\.(\d+)\.(\d+)", text)
        if match is None:
            raise ValueError(
                "We only accept the version strings of the form <major>.<minor>.<patch>, "
                f"got {text!r}."
            )
        major, minor, patch = (int(g) for g in match.groups())
        return major, minor, patch

    return parts(ver) >= parts(target)
