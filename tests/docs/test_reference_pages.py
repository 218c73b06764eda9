"""The generated reference pages cover every setting and every launcher option.

``docs/hooks/reference_pages.py`` writes them at each ``mkdocs build``; these tests check,
without building the site, that nothing in ``Config`` or the argument parser is left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path
from types import ModuleType

from baguahvd.common.config import Config
from baguahvd.runner.command_line import make_parser

HOOK = Path(__file__).resolve().parents[2] / "docs" / "hooks" / "reference_pages.py"


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference_pages", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_has_its_variables_on_the_page() -> None:
    hook = _hook()
    settings = {setting["field"]: setting for setting in hook.config_settings()}
    assert set(settings) == {field.name for field in dataclasses.fields(Config)}
    page = hook.environment_page()
    for setting in settings.values():
        for name in setting["variables"]:
            assert f"`{name}`" in page
    assert settings["fusion_threshold"]["variables"] == [
        "BAGUAHVD_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD",
    ]
    assert settings["peer_timeout_s"]["variables"] == ["BAGUAHVD_PEER_TIMEOUT_SECONDS"]
    assert "HOROVOD_CONTROLLER" in settings["cpu_backend"]["variables"]


def test_every_option_is_on_the_page() -> None:
    page = _hook().options_page()
    for action in make_parser()._actions:
        for option in action.option_strings:
            assert f"`{option}" in page, option
        if not action.option_strings and action.help != argparse.SUPPRESS:
            assert f"`{action.metavar or action.dest}`" in page
