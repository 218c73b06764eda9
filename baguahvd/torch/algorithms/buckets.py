"""Buckets: tensors communicated together as one flat buffer.

The partition follows Bagua: tensors in reverse parameter order (the order backward produces
gradients), grouped by dtype, a bucket closing as soon as it holds at least ``bucket_bytes``
(so it may overshoot by one tensor, and a large tensor gets a bucket of its own). Every rank
computes the same partition from the same parameter list.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from baguahvd.backends import memory


class Bucket:
    """Same-dtype tensors and the flat buffer they are communicated through.

    ``flat`` is padded with zeros to a multiple of ``alignment`` elements (compressed
    algorithms cut the buffer into one chunk per rank).
    """

    def __init__(
        self, index: int, named: Sequence[tuple[str, torch.Tensor]], alignment: int = 1
    ) -> None:
        self.index = index
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        padded = -(-self.numel // alignment) * alignment if alignment > 1 else self.numel
        first = self.params[0]
        self.flat = memory.zeros_buffer(padded, first)

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    def gather_grads(self) -> None:
        """Copies the parameters' gradients into ``flat`` (zeros for missing ones)."""
        offset = 0
        for p in self.params:
            count = p.numel()
            piece = self.flat[offset : offset + count]
            if p.grad is None:
                piece.zero_()
            else:
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                piece.copy_(grad.reshape(-1))
            offset += count

    def scatter_grads(self) -> None:
        """Writes ``flat`` back into the parameters' gradients."""
        offset = 0
        for p in self.params:
            count = p.numel()
            piece = self.flat[offset : offset + count].view_as(p)
            if p.grad is None or p.grad.is_sparse:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
            offset += count

    def gather_weights(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copies the parameters into ``out`` (default ``flat``) and returns it."""
        target = self.flat if out is None else out
        offset = 0
        for p in self.params:
            count = p.numel()
            target[offset : offset + count].copy_(p.detach().reshape(-1))
            offset += count
        return target

    def scatter_weights(self, source: torch.Tensor | None = None) -> None:
        """Writes ``source`` (default ``flat``) into the parameters."""
        values = self.flat if source is None else source
        offset = 0
        for p in self.params:
            count = p.numel()
            p.data.copy_(values[offset : offset + count].view_as(p))
            offset += count


_DTYPE_ORDER = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
                torch.float64: "f64"}


def split_into_buckets(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, alignment: int = 1
) -> list[Bucket]:
    """Partitions parameters into buckets (see the module docstring).

    Args:
        named: ``(name, parameter)`` in the optimizer's order; buckets take them reversed.
        bucket_bytes: a bucket closes once it holds at least this many bytes.
        alignment: pad each bucket's flat buffer to a multiple of this many elements.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}.")
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, p in reversed(list(named)):
        by_dtype.setdefault(p.dtype, []).append((name, p))
    buckets: list[Bucket] = []
    for dtype in sorted(by_dtype, key=lambda d: _DTYPE_ORDER.get(d, str(d))):
        current: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, p in by_dtype[dtype]:
            current.append((name, p))
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                buckets.append(Bucket(len(buckets), current, alignment))
                current, size = [], 0
        if current:
            buckets.append(Bucket(len(buckets), current, alignment))
    return buckets
