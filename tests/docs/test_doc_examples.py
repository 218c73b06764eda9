"""Runs the Python blocks of the documentation that are marked as complete programs.

Convention (also stated on the site's home page): a fenced ```python block preceded by the
line ``<!-- run -->`` runs in one process; one preceded by ``<!-- run: np=N -->`` runs under
``mpirun -np N``. Each run has a time limit, so a hanging example fails instead of blocking
the suite. Unmarked blocks are fragments and are not run.
"""

from __future__ import annotations

import json
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
"""Seconds allowed per example."""
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


# Starting Python and importing torch costs seconds, so the examples of one size run one
# after another in one job, each in a fresh namespace; a failure names its page and line.
_RUNNER = """
import json, sys, traceback
for where, code in json.load(open(sys.argv[1])):
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: {where}", flush=True)
        sys.exit(1)
    print(f"passed: {where}", flush=True)
"""


@pytest.mark.parametrize("ranks", sorted({ranks for _, ranks, _ in EXAMPLES}))
def test_doc_examples(ranks: int, tmp_path: Path) -> None:
    examples = [(where, code) for where, n, code in EXAMPLES if n == ranks]
    (tmp_path / "examples.json").write_text(json.dumps(examples))
    (tmp_path / "runner.py").write_text(_RUNNER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "runner.py", "examples.json"]
    if ranks > 1:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            pytest.skip("mpirun is not installed")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        command = [mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", *command]
    limit = TIMEOUT_S * len(examples)
    try:
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=limit
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"the examples did not finish within {limit} s:\n{exc.stdout!r}\n{exc.stderr!r}"
        )
    assert result.returncode == 0, (
        f"exit status {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )
