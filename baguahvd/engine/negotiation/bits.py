"""The byte vector each rank contributes to a cycle's bitwise AND (see
:mod:`~baguahvd.engine.negotiation.negotiator`): slot bits, and the flags of its last byte.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

# Flag bits of the last byte of the negotiation vector; a cleared bit means "yes", except
# for FLAG_UNNAMED_WAITS, whose AND is set when every rank's is.
FLAG_NOTHING_TO_SEND = 1
FLAG_NO_SHUTDOWN = 2
FLAG_NO_UNNAMED_IN_FULL = 4
FLAG_UNNAMED_WAITS = 8

_FEW_BITS = 16
"""Up to this many slots, bits are set and found one by one in Python integers; beyond,
numpy does it in bulk (a burst of hundreds of cache hits)."""


def vector(words: bytes) -> np.ndarray:
    """The control plane's writable ``uint8`` vector holding ``words``."""
    return np.frombuffer(bytearray(words), dtype=np.uint8)


def slot_bits(slots: Collection[int], span: int) -> int:
    """An integer with bit ``s`` set for each slot ``s`` of ``slots``."""
    if len(slots) <= _FEW_BITS:
        bits = 0
        for slot in slots:
            bits |= 1 << slot
        return bits
    marked = np.zeros(span * 8, dtype=bool)
    marked[list(slots)] = True
    return int.from_bytes(np.packbits(marked, bitorder="little").tobytes(), "little")


def set_bits(bits: int, span: int) -> list[int]:
    """The positions of the set bits of ``bits`` (below ``span`` bytes), lowest first."""
    positions: list[int] = []
    for _ in range(_FEW_BITS):
        if not bits:
            return positions
        lowest = bits & -bits
        positions.append(lowest.bit_length() - 1)
        bits ^= lowest
    if bits:
        rest = np.frombuffer(bits.to_bytes(span, "little"), dtype=np.uint8)
        positions += np.flatnonzero(np.unpackbits(rest, bitorder="little")).tolist()
    return positions
