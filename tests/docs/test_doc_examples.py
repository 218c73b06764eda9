"""Runs the Python blocks of the documentation that are marked as complete programs.

Convention (also stated on the site's home page): a fenced ```python block preceded by the
line ``<!-- run -->`` runs in one process; one preceded by ``<!-- run: np=N -->`` runs under
``mpirun -np N``. Each run has a time limit, so a hanging example fails instead of blocking
the suite. Unmarked blocks are fragments and are not run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TIMEOUT_S = 60
_BLOCK = re.compile(
    r"^<!-- run(?::\s*np=(?P<np>\d+))?\s*-->\s*\n```python\n(?P<code>.*?)^```",
    re.MULTILINE | re.DOTALL,
)


def doc_examples() -> list[tuple[str, int, str]]:
    """(page:line, ranks, code) of every marked block under docs/."""
    examples = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            ranks = int(match.group("np") or 1)
            examples.append((f"{page.relative_to(ROOT)}:{line}", ranks, match.group("code")))
    return examples


EXAMPLES = doc_examples()


def test_examples_are_found() -> None:
    assert len(EXAMPLES) >= 5, EXAMPLES
    assert any(ranks > 1 for _, ranks, _ in EXAMPLES)


@pytest.mark.parametrize(
    ("where", "ranks", "code"), EXAMPLES, ids=[where for where, _, _ in EXAMPLES]
)
def test_doc_example(where: str, ranks: int, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if ranks == 1:
        command = [sys.executable, str(script)]
    else:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            pytest.skip("mpirun is not installed")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        command = [mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none",
                   sys.executable, str(script)]
    try:
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{where} did not finish within {TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    assert result.returncode == 0, (
        f"{where} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )
