"""The copies of a fused CPU allreduce (``baguahvd.kernels.host_copy``): the extension built
from ``csrc/host_copy.c`` and the torch fallback copy the same bytes, and the extension
refuses what it cannot copy safely before it copies anything."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch

from baguahvd.kernels import host_copy

EXTENSION = host_copy._native
"""The extension as host_copy loaded and bound it (None where it is not built), kept before
any test swaps it out."""


@pytest.fixture(params=["extension", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "extension":
        if EXTENSION is None:
            pytest.skip("the host copy extension is not built (no C compiler at install)")
        monkeypatch.setattr(host_copy, "_native", EXTENSION)
    else:
        monkeypatch.setattr(host_copy, "_native", None)
    yield request.param


def _layout(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat buffer for ``tensors`` and views of it shaped as each (as FusionBuffers)."""
    counts = [t.numel() for t in tensors]
    buffer = torch.full((sum(counts),), 77, dtype=tensors[0].dtype)
    views = [part.view(t.shape) for part, t in zip(buffer.split(counts), tensors)]
    return buffer, views


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8])
def test_gather_and_scatter_copy_every_byte_in_order(path: str, dtype: torch.dtype) -> None:
    shapes = [(5,), (3, 4), (1,), (2, 3, 2), (0,), (7,)]
    tensors = [torch.arange(i * 100, i * 100 + torch.Size(s).numel()).reshape(s).to(dtype)
               for i, s in enumerate(shapes)]
    buffer, views = _layout(tensors)
    host_copy.gather(tensors, buffer, views, flat=False)
    assert torch.equal(buffer, torch.cat([t.reshape(-1) for t in tensors]))
    buffer.add_(1)  # the reduction's result, as far as the copy out can tell
    outputs = [torch.zeros_like(t) for t in tensors]
    host_copy.scatter(buffer, views, outputs)
    for output, view in zip(outputs, views):
        assert torch.equal(output, view)


def test_flat_tensors_and_a_buffer_with_room_to_spare(path: str) -> None:
    tensors = [torch.ones(3), torch.full((2,), 2.0)]
    buffer = torch.zeros(5)
    views = list(buffer.split([3, 2]))
    host_copy.gather(tensors, buffer, views, flat=True)
    assert buffer.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0]
    host_copy.gather([tensors[1], tensors[0]], buffer, list(buffer.split([2, 3])), flat=False)
    assert buffer.tolist() == [2.0, 2.0, 1.0, 1.0, 1.0]


@pytest.mark.skipif(EXTENSION is None, reason="the host copy extension is not built")
@pytest.mark.parametrize("bad", ["strided", "meta", "too_long", "not_a_tensor"])
def test_the_extension_refuses_before_it_copies(bad: str) -> None:
    good = torch.ones(4)
    others = {
        "strided": torch.ones(4, 2)[:, 0],
        "meta": torch.ones(4, device="meta"),
        "too_long": torch.ones(5),
        "not_a_tensor": object(),
    }
    buffer = torch.zeros(8)
    error = TypeError if bad == "not_a_tensor" else ValueError
    with pytest.raises(error):
        EXTENSION.gather([good, others[bad]], buffer.data_ptr(), buffer.nbytes)
    assert buffer.abs().sum() == 0  # nothing was copied, not even the good tensor
    outputs = [torch.zeros(4), others[bad]]
    with pytest.raises(error):
        EXTENSION.scatter(outputs, torch.ones(8).data_ptr(), 32)
    assert outputs[0].abs().sum() == 0


@pytest.mark.skipif(EXTENSION is None, reason="the host copy extension is not built")
def test_the_extension_refuses_a_bad_buffer() -> None:
    with pytest.raises(ValueError, match="negative"):
        EXTENSION.gather([torch.ones(1)], torch.ones(1).data_ptr(), -1)
    with pytest.raises(ValueError, match="null"):
        EXTENSION.gather([torch.ones(1)], 0, 4)
    with pytest.raises(ValueError, match="more than the buffer"):
        EXTENSION.gather([torch.ones(2)], torch.ones(1).data_ptr(), 4)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the package installs without the extension")
def test_the_extension_is_built_where_a_compiler_is_there() -> None:
    assert EXTENSION is not None and host_copy.native()
