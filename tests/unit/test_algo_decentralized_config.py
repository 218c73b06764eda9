"""Hyperparameter validation of the decentralized algorithms and the shift_one peer rule."""

from __future__ import annotations

from typing import Any

import pytest

from baguahvd.torch.algorithms.decentralized import DecentralizedAlgorithm, shift_one_peer
from baguahvd.torch.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
from tests.reference import decentralized_sim


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_hierarchical_must_be_a_bool(value: Any):
    with pytest.raises(ValueError, match="hierarchical"):
        DecentralizedAlgorithm(hierarchical=value)
    with pytest.raises(ValueError, match="hierarchical"):
        LowPrecisionDecentralizedAlgorithm(hierarchical=value)


@pytest.mark.parametrize("value", ["ring", "ALL", "", None, 1])
def test_peer_selection_mode_must_be_known(value: Any):
    with pytest.raises(ValueError, match="peer_selection_mode.*'all', 'shift_one'"):
        DecentralizedAlgorithm(peer_selection_mode=value)


@pytest.mark.parametrize("value", [0, -1, 1.0, 2.5, True, "2", None])
def test_communication_interval_must_be_a_positive_int(value: Any):
    with pytest.raises(ValueError, match="communication_interval"):
        DecentralizedAlgorithm(communication_interval=value)
    with pytest.raises(ValueError, match="communication_interval"):
        LowPrecisionDecentralizedAlgorithm(communication_interval=value)


def test_defaults_and_names():
    algorithm = DecentralizedAlgorithm()
    assert (algorithm.hierarchical, algorithm.peer_selection_mode,
            algorithm.communication_interval) == (True, "all", 1)
    assert algorithm.name == "decentralized"
    low = LowPrecisionDecentralizedAlgorithm(hierarchical=False, communication_interval=3)
    assert low.name == "low_precision_decentralized"
    assert repr(low) == (
        "LowPrecisionDecentralizedAlgorithm(hierarchical=False, communication_interval=3)"
    )


@pytest.mark.parametrize("size", [2, 4, 6, 8])
def test_shift_one_is_a_rotating_matching_between_the_halves(size: int):
    half = size // 2
    seen: set[tuple[int, int]] = set()
    for shift in range(2 * half):
        peers = [shift_one_peer(r, size, shift) for r in range(size)]
        assert peers == [
            decentralized_sim.shift_one_peer(r, size, shift) for r in range(size)
        ]
        for r, peer in enumerate(peers):
            assert peers[peer] == r
            assert (r < half) != (peer < half)
        seen.update((r, peers[r]) for r in range(half))
        if shift < half:
            assert len(seen) == half * (shift + 1)
    # Every cross-half pair meets once per half rotations.
    assert len(seen) == half * half


def test_shift_one_peer_first_rounds_at_four():
    assert [shift_one_peer(r, 4, 0) for r in range(4)] == [2, 3, 0, 1]
    assert [shift_one_peer(r, 4, 1) for r in range(4)] == [3, 2, 1, 0]
    assert [shift_one_peer(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
