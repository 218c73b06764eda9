"""The copies of a fused CPU allreduce: its tensors into one flat buffer, and back out.

Flat tensors go in by one ``torch.cat(out=)``. Tensors of other shapes go in, and every
tensor comes back out, by the extension built from ``csrc/host_copy.c`` where setup.py
could build it (a C compiler was there): one call checks every tensor (a contiguous CPU
tensor, all of them within the buffer) and then copies them by ``memcpy`` without the GIL.
Without it, ``torch._foreach_copy_`` copies them between the tensors and views of the
buffer, which costs about 0.4--0.8 us a tensor more than the extension at 4--16 KB a
tensor (``benchmarks/README.md``, "Host copies").
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch


def _load() -> ModuleType | None:
    try:
        from baguahvd.kernels import _host_copy  # type: ignore[attr-defined]
    except ImportError:  # not built: no C compiler at install time
        return None
    tensor = torch.Tensor
    _host_copy.bind(tensor.data_ptr, tensor.is_contiguous, tensor.nbytes, tensor.is_cpu)
    return _host_copy


_native = _load()


def native() -> bool:
    """Whether the copies run in the extension (else in torch)."""
    return _native is not None


def gather(tensors: list[torch.Tensor], buffer: torch.Tensor, views: list[torch.Tensor],
           flat: bool) -> None:
    """Copies ``tensors`` one after the other into the flat CPU ``buffer``, whose ``views``
    are shaped as the tensors; ``flat``: every tensor has one dimension (``torch.cat``
    takes them in one call with less per tensor than the extension's checks).

    Raises:
        ValueError: a tensor is not a contiguous CPU tensor, or they do not fit the buffer
            (the extension checks before it copies; torch raises its own errors).
    """
    if flat:
        torch.cat(tensors, out=buffer)
    elif _native is not None:
        _native.gather(tensors, buffer.data_ptr(), buffer.nbytes)
    else:
        copy_all(views, tensors)


def scatter(buffer: torch.Tensor, views: list[torch.Tensor],
            tensors: list[torch.Tensor]) -> None:
    """Copies consecutive pieces of the flat CPU ``buffer`` into ``tensors``; ``views``
    as for :func:`gather`."""
    if _native is not None:
        _native.scatter(tensors, buffer.data_ptr(), buffer.nbytes)
    else:
        copy_all(tensors, views)


def copy_all(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copies each of ``sources`` into the target beside it, tensors on any device, in one
    torch call (``_foreach_copy_``, or a ``copy_`` each where torch lacks it)."""
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is not None:
        copy(targets, sources)
    else:
        for target, source in zip(targets, sources):
            target.copy_(source)
