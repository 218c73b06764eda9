"""Torch implementation of every kernel: the CPU path and the oracle of the CUDA kernels.

Each function repeats the operation sequence of ``csrc/baguahvd_math.cuh`` with fp32 torch
ops, each rounded once (no fused multiply-add, no reciprocal in place of a division), so that
the results are bit-identical to the CUDA kernels. Scalars enter as 0-dim fp32 tensors on the
tensor's device so that torch neither rounds them differently nor rewrites a division by a
scalar into a multiplication by its reciprocal.

The functions take flat, contiguous, already checked tensors; :mod:`baguahvd.kernels.ops`
does the checking and picks this path or the CUDA one.
"""

from __future__ import annotations

import torch

from baguahvd.kernels.layout import HEADER_BYTES, NAN_BITS, MinMaxUInt8Layout

EPS = 1e-7
LEVELS = 255.0
TILE_ELEMENTS = 1 << 18

_BITS_DTYPES = {4: torch.int32, 2: torch.int16}


def _f32(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def quant_params(
    lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(scale, upper, lower)`` for fp32 chunk bounds ``lo`` and ``hi``."""
    device = lo.device
    scale = torch.div(_f32(LEVELS, device), (hi - lo) + _f32(EPS, device))
    upper = torch.round(hi * scale)
    lower = upper - _f32(LEVELS, device)
    return scale, upper, lower


def _padded_rows(values: torch.Tensor, rows: int, chunk: int) -> torch.Tensor:
    """fp32 ``[rows, chunk]`` view of ``values``, padded past its end with its last element.

    The padding cannot change the min or max of the chunk it lands in; its codes are zeroed
    afterwards and wholly empty chunks are reset by :func:`_chunk_bounds`.
    """
    values = _as_f32(values)
    count = values.numel()
    if count < rows * chunk:
        fill = values[-1:] if count else values.new_zeros(1)
        values = torch.cat([values, fill.expand(rows * chunk - count)])
    return values.view(rows, chunk)


def _chunk_bounds(
    padded: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-chunk fp32 ``(lo, hi, bad)`` of the rows of ``padded`` with ``valid`` elements."""
    rows, chunk = padded.shape
    device = padded.device
    if chunk == 0:
        zeros = torch.zeros(rows, dtype=torch.float32, device=device)
        return zeros, zeros.clone(), torch.zeros(rows, dtype=torch.bool, device=device)
    # two vectorized reductions beat one aminmax over rows several times over on the CPU
    lo, hi = torch.amin(padded, dim=1), torch.amax(padded, dim=1)
    empty = valid == 0
    bad = ~(torch.isfinite(lo) & torch.isfinite(hi)) & ~empty
    zero = torch.zeros((), dtype=torch.float32, device=device)
    nan = torch.full((), float("nan"), dtype=torch.float32, device=device)
    # Canonical +0 for signed zeros and empty chunks, NaN for chunks with a NaN or an Inf.
    lo = torch.where(bad, nan, torch.where((lo == 0) | empty, zero, lo))
    hi = torch.where(bad, nan, torch.where((hi == 0) | empty, zero, hi))
    return lo, hi, bad


def _header_bytes(
    lo: torch.Tensor, hi: torch.Tensor, bad: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The ``[rows, 2 * itemsize]`` header bytes: min and max in ``dtype``, canonical NaN."""
    words = torch.stack([lo, hi], dim=1).to(dtype)
    itemsize = words.element_size()
    bits = words.view(_BITS_DTYPES[itemsize])
    bits[bad] = NAN_BITS[dtype]
    return words.view(torch.uint8).view(-1, 2 * itemsize)


def _column_tiles(rows: int, chunk: int, device: torch.device) -> range:
    """Starts of the column tiles of a ``[rows, chunk]`` array, TILE_ELEMENTS per tile.

    The fallback runs several elementwise passes per element; on the CPU, doing them tile by
    tile keeps the intermediates in cache instead of streaming whole tensors through memory
    each time. Elsewhere one tile covers everything (more launches would only cost).
    """
    if device.type != "cpu":
        return range(0, chunk, max(chunk, 1))
    return range(0, chunk, max(1, TILE_ELEMENTS // max(rows, 1)))


def quantize(
    values: torch.Tensor,
    scale: torch.Tensor,
    upper: torch.Tensor,
    lower: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Writes the uint8 codes of fp32 ``values`` ``[rows, chunk]`` into ``out`` (same shape).

    ``scale``, ``upper`` and ``lower`` are per-row ``[rows, 1]``. The spec's
    ``saturate(min(r, upper) - lower)`` with ``r = rint(x * scale)`` is evaluated as
    ``clamp(r - lower, 0, min(upper - lower, 255))``, which gives the same codes with fewer
    passes: fp32 subtraction is monotonic, so ``r > upper`` still yields ``upper - lower``,
    and ``r < lower`` yields a non-positive difference that saturates to 0 either way. NaN,
    possible only in rows whose params are not finite, becomes 0 like in the saturating
    conversion of the CUDA path.
    """
    rows, chunk = values.shape
    top = torch.clamp(upper - lower, max=LEVELS)
    degenerate = not bool(torch.isfinite(lower).all())
    if degenerate:
        top.nan_to_num_(nan=0.0)
    # upper - lower is 255 except for huge magnitudes; a scalar clamp is much cheaper
    uniform_top = bool((top == LEVELS).all())
    tiles = _column_tiles(rows, chunk, values.device)
    scratch = torch.empty(rows, min(tiles.step, chunk), dtype=torch.float32, device=values.device)
    for start in tiles:
        stop = min(start + tiles.step, chunk)
        q = scratch[:, : stop - start]
        torch.mul(values[:, start:stop], scale, out=q)
        q.round_()
        q.sub_(lower)
        if degenerate:
            q.nan_to_num_(nan=0.0)
        if uniform_top:
            q.clamp_(0.0, LEVELS)
        else:
            q.clamp_(min=0.0)
            torch.minimum(q, top, out=q)
        out[:, start:stop].copy_(q)
    return out


def compress(
    tensor: torch.Tensor,
    layout: MinMaxUInt8Layout,
    out: torch.Tensor,
    target_chunk: int | None = None,
) -> torch.Tensor:
    """Compresses ``tensor`` (flat) into ``out`` (uint8, ``layout.total_bytes``).

    With ``target_chunk`` only that chunk's slot is written; the others are left untouched.
    """
    chunk, slot = layout.chunk_size, layout.slot_bytes
    if target_chunk is None:
        first, rows = 0, layout.n_chunks
        values = tensor
    else:
        first, rows = target_chunk, 1
        start = target_chunk * chunk
        values = tensor[start : start + layout.chunk_valid(target_chunk)]
    starts = torch.arange(first, first + rows, device=tensor.device) * chunk
    valid = (layout.numel - starts).clamp(0, chunk)
    padded = _padded_rows(values, rows, chunk)
    lo, hi, bad = _chunk_bounds(padded, valid)

    slots = out.view(layout.n_chunks, slot)[first : first + rows]
    header = _header_bytes(lo, hi, bad, tensor.dtype)
    slots[:, : header.shape[1]] = header
    slots[:, header.shape[1] : HEADER_BYTES] = 0
    slots[:, HEADER_BYTES + chunk :] = 0
    if chunk == 0:
        return out
    scale, upper, lower = quant_params(lo, hi)
    codes = slots[:, HEADER_BYTES : HEADER_BYTES + chunk]
    quantize(padded, scale[:, None], upper[:, None], lower[:, None], codes)
    count = values.numel()
    if count < rows * chunk:
        # zero the codes of the padding: the tail of the last partly filled row, then the
        # rows that hold no element at all
        full, rest = divmod(count, chunk)
        if rest:
            codes[full, rest:] = 0
            full += 1
        codes[full:] = 0
    return out


def _slot_params(
    buffer: torch.Tensor, layout: MinMaxUInt8Layout, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    slots = buffer.view(layout.n_chunks, layout.slot_bytes)
    words = slots[:, : 2 * itemsize].contiguous().view(dtype).float()
    return quant_params(words[:, 0], words[:, 1])


def _decode_rows(
    codes: torch.Tensor, scale: torch.Tensor, lower: torch.Tensor, out: torch.Tensor
) -> None:
    """``out = (codes + lower) / scale`` for ``[rows, width]`` codes and per-row params."""
    rows, width = codes.shape
    tiles = _column_tiles(rows, width, codes.device)
    scratch = None
    if out.dtype != torch.float32:
        scratch = torch.empty(rows, min(tiles.step, width), device=codes.device)
    for start in tiles:
        stop = min(start + tiles.step, width)
        values = out[:, start:stop] if scratch is None else scratch[:, : stop - start]
        values.copy_(codes[:, start:stop])
        values.add_(lower)
        values.div_(scale)
        if scratch is not None:
            out[:, start:stop].copy_(values)


def decompress(buffer: torch.Tensor, layout: MinMaxUInt8Layout, out: torch.Tensor) -> torch.Tensor:
    """Decompresses ``buffer`` into ``out`` (flat, ``layout.numel`` elements of its dtype)."""
    n, chunk = layout.n_chunks, layout.chunk_size
    if layout.numel == 0:
        return out
    scale, _, lower = _slot_params(buffer, layout, out.dtype)
    codes = buffer.view(n, layout.slot_bytes)[:, HEADER_BYTES : HEADER_BYTES + chunk]
    full, rest = divmod(layout.numel, chunk)
    if full:
        _decode_rows(
            codes[:full],
            scale[:full, None],
            lower[:full, None],
            out[: full * chunk].view(full, chunk),
        )
    if rest:  # the one partly filled chunk; the chunks after it are empty
        _decode_rows(
            codes[full : full + 1, :rest],
            scale[full : full + 1, None],
            lower[full : full + 1, None],
            out[full * chunk :].view(1, rest),
        )
    return out


def decompress_add_(
    tensor: torch.Tensor, buffer: torch.Tensor, layout: MinMaxUInt8Layout
) -> torch.Tensor:
    """``tensor += decompress(buffer)``, the decoded values rounded to the dtype first."""
    decoded = decompress(buffer, layout, torch.empty_like(tensor))
    if tensor.dtype == torch.float32:
        return tensor.add_(decoded)
    return tensor.copy_(tensor.float() + decoded.float())


def pairwise_sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Sums the rows of fp32 ``rows`` ``[m, c]`` as a pairwise tree (the CUDA order).

    Level by level, rows ``2i`` and ``2i + 1`` are added and an odd last row moves up
    unchanged: log2(m) vectorized steps.
    """
    while rows.shape[0] > 1:
        m = rows.shape[0]
        half = m // 2
        summed = rows[0 : 2 * half : 2] + rows[1 : 2 * half : 2]
        if m % 2:
            summed = torch.cat([summed, rows[m - 1 :]])
        rows = summed
    return rows[0]


def reduce_chunks(
    tensor: torch.Tensor, n_chunks: int, out: torch.Tensor, average: bool = True
) -> torch.Tensor:
    """Writes the fp32 pairwise sum (or mean) of the ``n_chunks`` chunks of ``tensor`` to ``out``.

    ``out`` may be one of the chunks of ``tensor``.
    """
    chunk = tensor.numel() // n_chunks
    total = pairwise_sum_rows(_as_f32(tensor).view(n_chunks, chunk))
    if average:
        total = torch.div(total, _f32(float(n_chunks), tensor.device))
    return out.copy_(total)


def decompress_reduce(
    buffer: torch.Tensor, layout: MinMaxUInt8Layout, out: torch.Tensor, average: bool = True
) -> torch.Tensor:
    """Decompresses all (full) chunks and reduces them into ``out`` (``chunk_size`` elements).

    Column tile by column tile: decode the tile of every chunk (rounded to ``out``'s dtype),
    sum the rows pairwise in fp32, divide, round. Identical to :func:`decompress` followed by
    :func:`reduce_chunks`, without the full decoded tensor.
    """
    n, chunk = layout.n_chunks, layout.chunk_size
    if chunk == 0:
        return out
    scale, _, lower = _slot_params(buffer, layout, out.dtype)
    codes = buffer.view(n, layout.slot_bytes)[:, HEADER_BYTES : HEADER_BYTES + chunk]
    tiles = _column_tiles(n, chunk, out.device)
    scratch = torch.empty(n, min(tiles.step, chunk), dtype=out.dtype, device=out.device)
    divisor = _f32(float(n), out.device)
    for start in tiles:
        stop = min(start + tiles.step, chunk)
        rows = scratch[:, : stop - start]
        _decode_rows(codes[:, start:stop], scale[:, None], lower[:, None], rows)
        total = pairwise_sum_rows(_as_f32(rows))
        if average:
            total = torch.div(total, divisor)
        out[start:stop].copy_(total)
    return out


def _store(x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    if result.data_ptr() != x.data_ptr():
        x.copy_(result)
    return x


def average_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x = (x + y) / 2``."""
    if x.dtype == torch.float32:
        return x.add_(y).div_(_f32(2.0, x.device))
    return _store(x, (x.float() + y.float()) / _f32(2.0, x.device))


def add_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x = x + y``."""
    if x.dtype == torch.float32:
        return x.add_(y)
    return _store(x, x.float() + y.float())


def subtract_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x = x - y``."""
    if x.dtype == torch.float32:
        return x.sub_(y)
    return _store(x, x.float() - y.float())


def addmul_(x: torch.Tensor, y: torch.Tensor, factor: float) -> torch.Tensor:
    """``x = x + factor * y`` (the product rounded to fp32 before the sum)."""
    f = _f32(factor, x.device)
    if x.dtype == torch.float32:
        return x.add_(y * f)
    return _store(x, x.float() + y.float() * f)


def scale_(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x = x * factor``."""
    if x.dtype in (torch.float16, torch.bfloat16):
        # One pass: torch multiplies 16-bit floats by a Python scalar in fp32 and rounds
        # once: the bits of the fp32 product stored back, NaN payloads aside
        # (tests/unit/test_kernels_host).
        return x.mul_(float(_f32(factor, torch.device("cpu"))))
    f = _f32(factor, x.device)
    if x.dtype == torch.float32:
        return x.mul_(f)
    return _store(x, x.float() * f)


def divide_(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x = x / divisor``."""
    d = _f32(divisor, x.device)
    if x.dtype == torch.float32:
        return x.div_(d)
    return _store(x, x.float() / d)


def async_model_average_(
    weights: torch.Tensor, reduced: torch.Tensor, snapshot: torch.Tensor, nranks: float
) -> torch.Tensor:
    """``w = w + (reduced / nranks - snapshot)``."""
    n = _f32(float(nranks), weights.device)
    correction = reduced.float() / n - snapshot.float()
    if weights.dtype == torch.float32:
        return weights.add_(correction)
    return _store(weights, weights.float() + correction)


def lowprec_decentralized_diff_(
    x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor
) -> torch.Tensor:
    """``x = (x - w) + ((l - w) + (r - w)) / 3``, i.e. ``x + l/3 + r/3 - 5w/3``."""
    w = weight.float()
    gossip = ((left.float() - w) + (right.float() - w)) / _f32(3.0, x.device)
    return _store(x, (x.float() - w) + gossip)
