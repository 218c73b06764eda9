"""The announced byte vector (``baguahvd.engine.negotiation.bits``): slots to bits and back."""

from __future__ import annotations

import pytest

from baguahvd.engine.negotiation.bits import set_bits, slot_bits


@pytest.mark.parametrize(
    "slots",
    [
        [], [0], [7, 8], [1023],
        list(range(0, 1024, 3)),
        [5, 16, 17, 200, 1000, *range(40, 60)],
    ],
)
def test_slot_bits_round_trip(slots: list[int]) -> None:
    # Few slots take the Python path, many the numpy one; both agree with the bytes on the
    # wire: bit s % 8 of byte s // 8.
    bits = slot_bits(set(slots), 128)
    assert set_bits(bits, 128) == sorted(slots)
    wire = bits.to_bytes(128, "little")
    assert [s for s in range(1024) if wire[s // 8] >> (s % 8) & 1] == sorted(slots)
