"""MkDocs hook: writes the reference pages that must not drift from the code.

At every build, ``on_files`` adds two generated pages to the site (they are never written
into ``docs/``, so there is no checked-in copy to go stale):

- ``reference/environment.md``: every field of :class:`baguahvd.common.config.Config`, its
  variables, default and docstring. The variables are read from ``Config.from_env``'s own
  calls (``_lookup``/``_as_bool``/``_as_number``/``_as_count`` with their ``horovod_alias``,
  and the full names in the helpers it calls), so a new setting shows up with its real
  names; a field whose variables cannot be found fails the build. Also the launchers'
  variables that ``hvd.init()`` reads (``launch_from_env``).
- ``reference/baguahvdrun.md``: every option of ``baguahvd.runner.command_line.make_parser()``,
  group by group, with its help text and default.

The same functions are used by ``tests/docs/test_reference_pages.py``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG_SOURCE = ROOT / "baguahvd" / "common" / "config.py"
_READERS = {"_lookup", "_as_bool", "_as_number", "_as_count"}
_VARIABLE = re.compile(r"^(?:BAGUAHVD|HOROVOD)_[A-Z0-9_]+$")

ENVIRONMENT_PAGE = "reference/environment.md"
OPTIONS_PAGE = "reference/baguahvdrun.md"


def _import_root() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------- environment


def _field_docstrings(tree: ast.Module, class_name: str) -> dict[str, str]:
    """The string literal that follows each annotated field of a class body."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            docs: dict[str, str] = {}
            body = node.body
            for current, following in zip(body, body[1:]):
                if (
                    isinstance(current, ast.AnnAssign)
                    and isinstance(current.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)
                ):
                    docs[current.target.id] = inspect.cleandoc(following.value.value)
            return docs
    raise LookupError(f"class {class_name} not found in {CONFIG_SOURCE}")


def _variables_of(
    node: ast.AST,
    assignments: dict[str, ast.AST],
    functions: dict[str, ast.FunctionDef],
    seen: set[str],
) -> list[str]:
    """The environment variables an expression of ``from_env`` reads, in order."""
    found: list[str] = []

    def add(name: str) -> None:
        if name not in found:
            found.append(name)

    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
            callee = sub.func.id
            if callee in _READERS:
                names = [
                    arg.value
                    for arg in sub.args
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                ]
                if names:
                    alias = True
                    for keyword in sub.keywords:
                        if keyword.arg == "horovod_alias" and isinstance(
                            keyword.value, ast.Constant
                        ):
                            alias = bool(keyword.value.value)
                    add(f"BAGUAHVD_{names[0]}")
                    if alias:
                        add(f"HOROVOD_{names[0]}")
            elif callee in functions and callee not in seen:
                seen.add(callee)
                for name in _variables_of(functions[callee], assignments, functions, seen):
                    add(name)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            if _VARIABLE.match(sub.value):
                add(sub.value)
        elif isinstance(sub, ast.Name) and sub.id in assignments and sub.id not in seen:
            seen.add(sub.id)
            for name in _variables_of(assignments[sub.id], assignments, functions, seen):
                add(name)
    return found


def config_settings() -> list[dict[str, Any]]:
    """Every Config field: name, variables, default, docstring."""
    _import_root()
    from baguahvd.common.config import Config

    tree = ast.parse(CONFIG_SOURCE.read_text())
    docs = _field_docstrings(tree, "Config")
    functions = {
        node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
    }
    from_env = next(
        item
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "Config"
        for item in node.body
        if isinstance(item, ast.FunctionDef) and item.name == "from_env"
    )
    assignments: dict[str, ast.AST] = {}
    keywords: dict[str, ast.AST] = {}
    for node in ast.walk(from_env):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assignments[target.id] = node.value
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "cls"
        ):
            keywords = {kw.arg: kw.value for kw in node.keywords if kw.arg}
    settings = []
    for field in dataclasses.fields(Config):
        if field.name not in keywords:
            raise LookupError(f"Config.{field.name} is not read by Config.from_env")
        variables = _variables_of(keywords[field.name], assignments, functions, set())
        if not variables:
            raise LookupError(f"no environment variable found for Config.{field.name}")
        if field.name not in docs:
            raise LookupError(f"Config.{field.name} has no docstring")
        default = field.default
        settings.append(
            {
                "field": field.name,
                "variables": variables,
                "default": default,
                "doc": docs[field.name],
            }
        )
    return settings


def _default_text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value) if value else "unset"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _md_text(text: str) -> str:
    """A docstring as Markdown: reST literals become code spans, lines are joined."""
    text = re.sub(r":(?:func|class|mod|meth|attr):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return " ".join(line.strip() for line in text.splitlines())


def launcher_variables() -> list[tuple[str, tuple[str, ...]]]:
    _import_root()
    from baguahvd.common import config

    return [
        ("MPI launchers (mpirun, srun --mpi=pmix, MPICH)", config._MPI_LAUNCH),
        ("horovodrun --gloo", config._HOROVOD_GLOO),
        ("torchrun (also baguahvdrun --gloo)", config._TORCHRUN),
        ("the rank, in this order of precedence", config._RANK_VARIABLES),
    ]


def environment_page() -> str:
    lines = [
        "# Environment variables",
        "",
        "<!-- Generated at build time by docs/hooks/reference_pages.py from",
        "     baguahvd/common/config.py. Edit the docstrings there, not this page. -->",
        "",
        "Settings are read once, at `hvd.init()`, by `baguahvd.common.config.Config.from_env`, "
        "the only reader of `os.environ` in the package. Where a setting lists both a "
        "`BAGUAHVD_*` and a `HOROVOD_*` variable, the `BAGUAHVD_*` one wins when both are set. "
        "Numbers are checked strictly: inf, nan, negative values and fractions of a count are "
        "errors at `init()` naming the variable, never rounded or clamped.",
        "",
        "This page is generated from the code at every build of the site.",
        "",
        "| variables | default | meaning |",
        "|---|---|---|",
    ]
    for setting in config_settings():
        names = "<br>".join(f"`{name}`" for name in setting["variables"])
        doc = _md_text(setting["doc"]).replace("|", "\\|")
        lines.append(f"| {names} | `{_default_text(setting['default'])}` | {doc} |")
    lines += [
        "",
        "## What the launchers set",
        "",
        "`hvd.init()` reads these to tell which launcher started the process and which "
        "transport to use (see [Launching](../guides/launching.md)); you never set them "
        "yourself.",
        "",
        "| launcher | variables |",
        "|---|---|",
    ]
    for label, variables in launcher_variables():
        listed = ", ".join(f"`{name}`" for name in variables)
        lines.append(f"| {label} | {listed} |")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- baguahvdrun


def _option_rows(
    group: argparse._ArgumentGroup, parser: argparse.ArgumentParser
) -> list[str]:
    rows = []
    for action in group._group_actions:
        if isinstance(action, argparse._HelpAction):
            names = ", ".join(f"`{name}`" for name in action.option_strings)
            rows.append(f"| {names} | | show the help and exit |")
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            metavar = ""
            if action.nargs != 0:
                shown = action.metavar or action.dest.upper()
                if isinstance(shown, tuple):
                    shown = " ".join(shown)
                metavar = f" {shown}"
                if action.nargs in ("+", "*"):
                    metavar += " ..."
            names = ", ".join(f"`{name}{metavar}`" for name in action.option_strings)
        else:
            names = f"`{action.metavar or action.dest}`"
        # The "off" half of an on/off pair shares its destination and has its own row only
        # when it has help text; otherwise name it next to the "on" half.
        partners = [
            other
            for other in parser._actions
            if other is not action
            and other.dest == action.dest
            and other.help == argparse.SUPPRESS
            and other.option_strings
        ]
        if partners:
            names += " (undo: " + ", ".join(
                f"`{name}`" for other in partners for name in other.option_strings
            ) + ")"
        default = action.default
        default_text = "" if default in (None, False, argparse.SUPPRESS) else f"`{default}`"
        help_text = (action.help or "").replace("%(default)s", str(default))
        help_text = help_text.replace("%%", "%").replace("|", "\\|")
        if action.choices:
            help_text += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
        rows.append(f"| {names} | {default_text} | {help_text} |")
    return rows


def options_page() -> str:
    _import_root()
    from baguahvd.runner.command_line import make_parser

    parser = make_parser()
    lines = [
        "# baguahvdrun options",
        "",
        "<!-- Generated at build time by docs/hooks/reference_pages.py from",
        "     baguahvd/runner/command_line.py. Edit the help texts there, not this page. -->",
        "",
        "`baguahvdrun` (also `python -m baguahvd.run`) takes every option of horovodrun "
        "0.28.1 and some of its own. What each option turns into (variables on the ranks, "
        "`mpirun` flags) is described in [Launching](../guides/launching.md). This page is "
        "generated from the launcher's argument parser at every build of the site.",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
    ]
    for group in parser._action_groups:
        rows = _option_rows(group, parser)
        if not rows:
            continue
        title = group.title or "options"
        lines += [f"## {title[0].upper()}{title[1:]}", ""]
        if group.description:
            lines += [group.description, ""]
        lines += ["| option | default | meaning |", "|---|---|---|", *rows, ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the hook


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, build in ((ENVIRONMENT_PAGE, environment_page), (OPTIONS_PAGE, options_page)):
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=build()))
    return files
