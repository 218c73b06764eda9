"""``--config-file``: ``horovodrun``'s YAML file of tuning settings.

The file has the sections ``horovodrun`` reads, each a mapping (every key optional)::

    controller: mpi            # or gloo
    params:          {fusion_threshold_mb: 32, cycle_time_ms: 2.5, cache_capacity: 2048,
                      hierarchical_allreduce: false, hierarchical_allgather: false}
    autotune:        {enabled: true, log_file: at.csv, warmup_samples: 3, steps_per_sample: 10,
                      bayes_opt_max_samples: 20, gaussian_process_noise: 0.8}
    timeline:        {filename: tl.json, mark_cycles: true}
    stall_check:     {enabled: true, warning_time_seconds: 60, shutdown_time_seconds: 0}
    library_options: {mpi_threads_disable: false, num_nccl_streams: 1, thread_affinity: 0,
                      gloo_timeout_seconds: 30}
    logging:         {level: warning, with_timestamp: true}

A setting given on the command line wins over the file, wherever the flags stand. Unknown
sections and keys are reported as notes and otherwise ignored, as ``horovodrun`` ignores
them; a value of the wrong type is an error naming its key. Reading needs PyYAML
(``pip install baguahvd[config]``), imported only when a file is given.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from baguahvd.runner.hosts import LaunchError

try:
    import yaml
except ImportError:  # PyYAML is an optional dependency, needed for --config-file only
    yaml = None  # type: ignore[assignment]

Converter = Callable[[str, Any], Any]


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise LaunchError(f"{key}: expected true or false, got {value!r}")
    return value


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LaunchError(f"{key}: expected an integer, got {value!r}")
    return value


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LaunchError(f"{key}: expected a number, got {value!r}")
    return float(value)


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise LaunchError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _affinity(key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _string(key, value)


def _log_level(key: str, value: Any) -> str:
    return _string(key, value).lower()


def _negated(key: str, value: Any) -> bool:
    return not _boolean(key, value)


SECTIONS: Mapping[str, Mapping[str, tuple[str, Converter]]] = {
    "params": {
        "fusion_threshold_mb": ("fusion_threshold_mb", _number),
        "cycle_time_ms": ("cycle_time_ms", _number),
        "cache_capacity": ("cache_capacity", _integer),
        "hierarchical_allreduce": ("hierarchical_allreduce", _boolean),
        "hierarchical_allgather": ("hierarchical_allgather", _boolean),
    },
    "autotune": {
        "enabled": ("autotune", _boolean),
        "log_file": ("autotune_log_file", _string),
        "warmup_samples": ("autotune_warmup_samples", _integer),
        "steps_per_sample": ("autotune_steps_per_sample", _integer),
        "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", _integer),
        "gaussian_process_noise": ("autotune_gaussian_process_noise", _number),
    },
    "timeline": {
        "filename": ("timeline_filename", _string),
        "mark_cycles": ("timeline_mark_cycles", _boolean),
    },
    "stall_check": {
        "enabled": ("no_stall_check", _negated),
        "warning_time_seconds": ("stall_check_warning_time_seconds", _number),
        "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", _number),
    },
    "library_options": {
        "mpi_threads_disable": ("mpi_threads_disable", _boolean),
        "num_nccl_streams": ("num_nccl_streams", _integer),
        "thread_affinity": ("thread_affinity", _affinity),
        "ccl_bgt_affinity": ("thread_affinity", _affinity),
        "gloo_timeout_seconds": ("gloo_timeout_seconds", _integer),
    },
    "logging": {
        "level": ("log_level", _log_level),
        "with_timestamp": ("log_with_timestamp", _boolean),
    },
}
"""Section → key → (attribute of the parsed command line, converter of the YAML value)."""
CONTROLLERS = {"mpi": "use_mpi", "gloo": "use_gloo"}


def read_config(path: str) -> dict[str, Any]:
    """Reads a ``--config-file``.

    Args:
        path: the file name.

    Returns:
        The top-level mapping (empty for an empty file).

    Raises:
        LaunchError: PyYAML is missing, the file cannot be read or parsed, or its top
            level is not a mapping.
    """
    if yaml is None:
        raise LaunchError(
            "--config-file needs PyYAML: pip install pyyaml (or baguahvd[config])"
        )
    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except OSError as error:
        raise LaunchError(f"cannot read --config-file {path!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise LaunchError(f"--config-file {path!r} is not valid YAML: {error}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise LaunchError(f"--config-file {path!r}: the top level must be a mapping")
    return config


def apply_config(
    args: argparse.Namespace, config: Mapping[str, Any], where: str = "--config-file"
) -> list[str]:
    """Fills the settings the command line left unset from a config file's content.

    Args:
        args: the parsed command line, changed in place; an attribute that is not ``None``
            (or, for the controller, a ``--gloo``/``--mpi`` flag) was given and stays.
        config: the file's top-level mapping (see :func:`read_config`).
        where: how messages name the file.

    Returns:
        Notes about the sections and keys that were ignored.

    Raises:
        LaunchError: an unknown controller, a section that is not a mapping, or a value of
            the wrong type; the message names the key.
    """
    notes: list[str] = []
    for section, content in config.items():
        if section == "controller":
            _apply_controller(args, content, where)
            continue
        keys = SECTIONS.get(section)
        if keys is None:
            notes.append(f"{where}: section {section!r} is not a horovodrun setting; ignored")
            continue
        if content is None:
            continue
        if not isinstance(content, dict):
            raise LaunchError(f"{where}: section {section!r} must be a mapping")
        for key, value in content.items():
            if key not in keys:
                notes.append(f"{where}: {section}.{key} is not a horovodrun setting; ignored")
                continue
            attribute, convert = keys[key]
            if value is not None and getattr(args, attribute, None) is None:
                setattr(args, attribute, convert(f"{where}: {section}.{key}", value))
    return notes


def _apply_controller(args: argparse.Namespace, value: Any, where: str) -> None:
    if not isinstance(value, str) or value.lower() not in CONTROLLERS:
        raise LaunchError(f"{where}: controller must be 'mpi' or 'gloo', got {value!r}")
    if not (args.use_gloo or args.use_mpi or args.use_jsrun):
        setattr(args, CONTROLLERS[value.lower()], True)
