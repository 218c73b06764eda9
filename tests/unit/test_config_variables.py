"""The configuration (``baguahvd.common.config``): Horovod's defaults and variable names,
BAGUAHVD_* overrides, and errors that name the variable."""

from __future__ import annotations

import pytest

from baguahvd.common.config import Config


def test_config_defaults_are_horovods() -> None:
    config = Config.from_env({})
    assert config.fusion_threshold == 128 * 1024 * 1024
    assert config.cycle_time_ms == 1.0
    assert config.cache_capacity == 1024
    assert config.stall_check_time_s == 60.0
    # Deliberately unlike Horovod (which never shuts down): a stall ends the job after 10 min.
    assert config.stall_shutdown_time_s == 600.0
    assert config.dynamic_process_sets is False
    assert config.hierarchical_allreduce is False
    assert config.timeline is None
    assert config.log_level == "warning"
    assert config == Config()


def test_config_reads_horovod_variables() -> None:
    config = Config.from_env({
        "HOROVOD_FUSION_THRESHOLD": "1048576",
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "0",
        "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "true",
        "HOROVOD_TIMELINE": "DYNAMIC",
        "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_THREAD_AFFINITY": "0,2",
    })
    assert config.fusion_threshold == 1048576
    assert config.cycle_time_ms == 2.5
    assert config.cache_capacity == 0
    assert config.dynamic_process_sets is True
    assert config.hierarchical_allreduce is True
    assert config.timeline == "DYNAMIC"
    assert config.log_level == "debug"
    assert config.thread_affinity == (0, 2)


def test_baguahvd_variables_override_horovod_ones() -> None:
    config = Config.from_env({
        "HOROVOD_FUSION_THRESHOLD": "100",
        "BAGUAHVD_FUSION_THRESHOLD": "200",
        "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
        "BAGUAHVD_DYNAMIC_PROCESS_SETS": "0",
        "BAGUAHVD_CYCLE_TIME": "5",
    })
    assert config.fusion_threshold == 200
    assert config.dynamic_process_sets is False
    assert config.cycle_time_ms == 5.0


def test_empty_values_mean_default() -> None:
    config = Config.from_env({"HOROVOD_FUSION_THRESHOLD": "", "HOROVOD_CYCLE_TIME": " "})
    assert config.fusion_threshold == Config.fusion_threshold
    assert config.cycle_time_ms == Config.cycle_time_ms


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("HOROVOD_FUSION_THRESHOLD", "lots"),
        ("HOROVOD_FUSION_THRESHOLD", "-1"),
        ("BAGUAHVD_CYCLE_TIME", "fast"),
        ("HOROVOD_CACHE_CAPACITY", "1k"),
        ("HOROVOD_DYNAMIC_PROCESS_SETS", "maybe"),
        ("HOROVOD_LOG_LEVEL", "loud"),
        ("HOROVOD_THREAD_AFFINITY", "0,x"),
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "soon"),
    ],
)
def test_bad_values_name_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ValueError, match=variable):
        Config.from_env({variable: value})


def test_config_is_frozen() -> None:
    config = Config.from_env({})
    with pytest.raises(AttributeError):
        config.fusion_threshold = 1  # type: ignore[misc]
