"""Independent numpy oracle of MinMaxUInt8 and the elementwise kernels, written from the spec.

Deliberately naive: one Python loop per chunk, numpy float32 scalars for every step, and its
own bfloat16 rounding. Values travel as float32 arrays holding values that are exact in the
source dtype ("f32", "f16" or "bf16"); buffers as uint8 arrays.

Format (bagua_spec.md section 2): chunk_size C = ceil(numel / n); slot S = roundup(C, 32) + 32
bytes per chunk; slot header = min, max in the source dtype, zero to byte 32; then one code per
element, zero padding. scale = 255 / (max - min + 1e-7); upper = rint(max * scale);
lower = upper - 255; code = clamp(min(rint(x * scale), upper) - lower, 0, 255) (NaN -> 0);
decode = (code + lower) / scale, rounded to the source dtype. Project policy for what the spec
leaves open: a chunk with NaN/Inf stores NaN as min and max, an empty chunk stores 0, 0, and a
signed zero is stored as +0.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
EPS = F32(1e-7)
LEVELS = F32(255)
HEADER = 32
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
NAN_BITS = {"f32": 0x7FC00000, "f16": 0x7E00, "bf16": 0x7FC0}


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16); NaN stays NaN."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    return np.where(nan, np.uint16(0x7FC0), rounded)


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to ``dtype`` and widened back to float32."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "f32":
        return values.copy()
    if dtype == "f16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16).astype(np.float32)
    return (bf16_bits(values).astype(np.uint32) << 16).view(np.float32)


def _word_bytes(value: np.float32, dtype: str) -> bytes:
    if dtype == "f32":
        return np.array([value], dtype=np.float32).tobytes()
    if dtype == "f16":
        return np.array([value], dtype=np.float32).astype(np.float16).tobytes()
    return bf16_bits(np.array([value], dtype=np.float32)).tobytes()


def _word_value(raw: bytes, dtype: str) -> np.float32:
    if dtype == "f32":
        return np.frombuffer(raw, dtype=np.float32)[0]
    if dtype == "f16":
        return F32(np.frombuffer(raw, dtype=np.float16)[0])
    bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)[0]


def layout(numel: int, n_chunks: int) -> tuple[int, int]:
    """Returns (chunk_size, slot_bytes)."""
    chunk = -(-numel // n_chunks)
    return chunk, -(-chunk // HEADER) * HEADER + HEADER


def params(lo: np.float32, hi: np.float32) -> tuple[np.float32, np.float32, np.float32]:
    """(scale, upper, lower) of a chunk, every step a float32 operation."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        scale = F32(LEVELS / F32(F32(hi - lo) + EPS))
        upper = F32(np.rint(F32(hi * scale)))
        lower = F32(upper - LEVELS)
    return scale, upper, lower


def compress(values: np.ndarray, dtype: str, n_chunks: int) -> np.ndarray:
    """Compressed buffer (uint8) of float32 ``values`` that are exact in ``dtype``."""
    values = np.asarray(values, dtype=np.float32)
    numel = values.size
    chunk, slot = layout(numel, n_chunks)
    out = np.zeros(n_chunks * slot, dtype=np.uint8)
    size = ITEMSIZE[dtype]
    for j in range(n_chunks):
        part = values[j * chunk : min((j + 1) * chunk, numel)]
        base = j * slot
        if part.size and not np.all(np.isfinite(part)):
            nan = np.array([NAN_BITS[dtype]], dtype=np.uint32 if size == 4 else np.uint16)
            out[base : base + size] = np.frombuffer(nan.tobytes(), dtype=np.uint8)
            out[base + size : base + 2 * size] = np.frombuffer(nan.tobytes(), dtype=np.uint8)
            continue  # NaN params make every code 0
        lo = F32(part.min()) + F32(0) if part.size else F32(0)
        hi = F32(part.max()) + F32(0) if part.size else F32(0)
        out[base : base + size] = np.frombuffer(_word_bytes(lo, dtype), dtype=np.uint8)
        out[base + size : base + 2 * size] = np.frombuffer(_word_bytes(hi, dtype), dtype=np.uint8)
        scale, upper, lower = params(lo, hi)
        with np.errstate(over="ignore", invalid="ignore"):
            q = np.minimum(np.rint(part * scale), upper) - lower
        q = np.where(np.isnan(q), F32(0), np.clip(q, F32(0), LEVELS))
        out[base + HEADER : base + HEADER + part.size] = q.astype(np.uint8)
    return out


def decompress(buffer: np.ndarray, dtype: str, numel: int, n_chunks: int) -> np.ndarray:
    """float32 values (exact in ``dtype``) decoded from a buffer."""
    buffer = np.asarray(buffer, dtype=np.uint8)
    chunk, slot = layout(numel, n_chunks)
    assert buffer.size == n_chunks * slot, (buffer.size, n_chunks * slot)
    size = ITEMSIZE[dtype]
    out = np.zeros(numel, dtype=np.float32)
    for j in range(n_chunks):
        base = j * slot
        lo = _word_value(buffer[base : base + size].tobytes(), dtype)
        hi = _word_value(buffer[base + size : base + 2 * size].tobytes(), dtype)
        scale, _, lower = params(lo, hi)
        count = max(min(numel - j * chunk, chunk), 0)
        codes = buffer[base + HEADER : base + HEADER + count].astype(np.float32)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            decoded = (codes + lower) / scale
        out[j * chunk : j * chunk + count] = round_to(decoded, dtype)
    return out


def pairwise_sum(rows: list[np.ndarray]) -> np.ndarray:
    """float32 pairwise tree sum: neighbours added level by level, an odd last one carried."""
    while len(rows) > 1:
        nxt = [rows[i] + rows[i + 1] for i in range(0, len(rows) - 1, 2)]
        if len(rows) % 2:
            nxt.append(rows[-1])
        rows = nxt
    return rows[0]


def reduce_chunks(values: np.ndarray, dtype: str, n_chunks: int, average: bool) -> np.ndarray:
    """Sum (or mean) of the chunks, fp32 pairwise accumulation, rounded to ``dtype``."""
    values = np.asarray(values, dtype=np.float32)
    rows = list(values.reshape(n_chunks, -1))
    total = pairwise_sum(rows)
    if average:
        total = total / F32(n_chunks)
    return round_to(total, dtype)


def elementwise(op: str, dtype: str, *args: np.ndarray | float) -> np.ndarray:
    """The elementwise kernels in float32, rounded once to ``dtype``."""
    a = [np.asarray(x, dtype=np.float32) if isinstance(x, np.ndarray) else F32(x) for x in args]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if op == "average":
            r = (a[0] + a[1]) / F32(2)
        elif op == "add":
            r = a[0] + a[1]
        elif op == "subtract":
            r = a[0] - a[1]
        elif op == "addmul":
            r = a[0] + a[1] * a[2]
        elif op == "scale":
            r = a[0] * a[1]
        elif op == "divide":
            r = a[0] / a[1]
        elif op == "async":
            r = a[0] + (a[1] / a[3] - a[2])
        elif op == "lowprec":
            x, w, left, right = a
            r = (x - w) + ((left - w) + (right - w)) / F32(3)
        else:
            raise ValueError(op)
    return round_to(r, dtype)
