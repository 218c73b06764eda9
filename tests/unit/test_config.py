"""Strict settings: a value that means nothing is an error naming its variable, never rounded,
clamped or silently ignored."""

from __future__ import annotations

import pytest

from baguahvd.common.config import Config


@pytest.mark.parametrize(
    ("variable", "value", "reason"),
    [
        ("HOROVOD_FUSION_THRESHOLD", "inf", "finite"),
        ("HOROVOD_FUSION_THRESHOLD", "1e400", "finite"),
        ("HOROVOD_FUSION_THRESHOLD", "1.5", "whole number"),
        ("HOROVOD_CYCLE_TIME", "nan", "finite"),
        ("HOROVOD_CYCLE_TIME", "-inf", "finite"),
        ("HOROVOD_CYCLE_TIME", "-0.5", "negative"),
        ("HOROVOD_CACHE_CAPACITY", "1.5", "whole number"),
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "inf", "finite"),
        ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "nan", "finite"),
        ("BAGUAHVD_PEER_TIMEOUT_SECONDS", "-1", "negative"),
        ("BAGUAHVD_EXIT_TIMEOUT_SECONDS", "inf", "finite"),
        ("BAGUAHVD_BUCKET_SIZE", "0", "less than 1"),
        ("BAGUAHVD_BUCKET_SIZE", "1024.5", "whole number"),
        ("HOROVOD_NUM_NCCL_STREAMS", "0", "less than 1"),
        ("BAGUAHVD_TIMELINE_START_STEP", "2.5", "whole number"),
        ("BAGUAHVD_ELASTIC_RESTART", "-1", "negative"),
        ("BAGUAHVD_ELASTIC_PERSIST_EVERY", "0", "less than 1"),
        ("BAGUAHVD_ELASTIC_PERSIST_EVERY", "2.5", "whole number"),
        ("BAGUAHVD_ELASTIC_PERSIST_EVERY", "often", "not a number"),
        ("BAGUAHVD_UNFUSED_BYTES", "-1", "negative"),
        ("BAGUAHVD_UNFUSED_BYTES", "2.5", "whole number"),
    ],
)
def test_meaningless_numbers_are_rejected(variable: str, value: str, reason: str) -> None:
    with pytest.raises(ValueError, match=variable) as info:
        Config.from_env({variable: value})
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        ("HOROVOD_FUSION_THRESHOLD", "1e6", "fusion_threshold", 1_000_000),
        ("HOROVOD_FUSION_THRESHOLD", "0", "fusion_threshold", 0),
        ("HOROVOD_CYCLE_TIME", "0", "cycle_time_ms", 0.0),
        ("HOROVOD_CYCLE_TIME", "0.25", "cycle_time_ms", 0.25),
        ("HOROVOD_CACHE_CAPACITY", "16.0", "cache_capacity", 16),
        ("BAGUAHVD_BUCKET_SIZE", "1", "bucket_bytes", 1),
        ("HOROVOD_NUM_NCCL_STREAMS", "2", "num_nccl_streams", 2),
        ("BAGUAHVD_UNFUSED_BYTES", "0", "unfused_bytes", 0),
        ("BAGUAHVD_UNFUSED_BYTES", "4194304", "unfused_bytes", 4 << 20),
        ("BAGUAHVD_ELASTIC_PERSIST_EVERY", "5", "elastic_persist_every", 5),
    ],
)
def test_meaningful_numbers_are_read_exactly(
    variable: str, value: str, field: str, expected: float
) -> None:
    config = Config.from_env({variable: value})
    assert getattr(config, field) == expected
    assert type(getattr(config, field)) is type(expected)


def test_unset_unfused_size_leaves_it_to_the_data_plane() -> None:
    assert Config.from_env({}).unfused_bytes is None
    assert Config.from_env({"BAGUAHVD_UNFUSED_BYTES": " "}).unfused_bytes is None
    # No Horovod alias: Horovod fuses every tensor.
    assert Config.from_env({"HOROVOD_UNFUSED_BYTES": "0"}).unfused_bytes is None


def test_shutdown_below_check_time_is_rejected_not_ignored() -> None:
    env = {
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5",
    }
    with pytest.raises(ValueError, match="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5 is less than "
                       "HOROVOD_STALL_CHECK_TIME_SECONDS=60"):
        Config.from_env(env)


@pytest.mark.parametrize(
    "env",
    [
        {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"},
        {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"},
        {"HOROVOD_STALL_CHECK_TIME_SECONDS": "60", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"},
        # With the inspector off neither time is used, so their order does not matter.
        {"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"},
    ],
)
def test_consistent_stall_times_are_accepted(env: dict[str, str]) -> None:
    Config.from_env(env)
