"""The GPU check: one command that exercises baguahvd's GPU path on a machine with one CUDA
GPU and no MPI, and writes one summary (JSON and Markdown).

    benchmarks/gpu_check.sh                 # the usual way (sets PYTHONPATH, checks the GPU)
    python3 benchmarks/gpu_check.py --list  # the parts
    python3 benchmarks/gpu_check.py --only kernels,collectives_nccl

Every part runs in a process of its own under its own timeout, and records pass, fail or
skip with its errors; a failing or hanging part never stops the others. A total time budget
(``--budget``, 450 s by default) bounds the whole run: a part gets at most what is left,
and parts that no longer fit are recorded as not run. The engine runs under
``torchrun --standalone`` (gloo control plane, no MPI); with one rank, once as it is (the
identity fast path) and once with BAGUAHVD_NCCL_SINGLE_RANK=1 (a one-rank NCCL
communicator). Those runs set NCCL_DEBUG=INFO, and the summary says which NCCL
communicators their logs show, so that a part meant to go through NCCL proves it did.

Parts (``*`` optional: they never change the exit status):

1. ``versions``: Python, torch, CUDA, CuPy, NCCL, NVRTC, GPU, driver, baguahvd's location;
2. ``cuda_tests``: ``pytest -m cuda tests`` (counts from its JUnit XML);
   ``cuda_tests_one_rank`` *: ``tests/parallel/test_cuda.py`` as one torchrun rank through
   a one-rank NCCL communicator (tests that need two ranks fail there by design);
3. ``collectives``/``collectives_nccl``: every collective, fp32/fp16/bf16, Sum and Average
   with scale factors, fused and grouped, against a CPU oracle;
4. ``stream_order``/``stream_order_nccl``: a producer on a side stream held by
   ``torch.cuda._sleep``; collectives submitted from that stream must see its value;
5. ``optimizer``/``optimizer_nccl``: DistributedOptimizer steps against the same steps on
   the CPU;
6. ``algorithms``/``algorithms_nccl``: every Bagua algorithm trains with finite losses;
7. ``kernels``: the CUDA kernels bit for bit against the torch oracle, and their bandwidth
   against a device-to-device copy;
8. ``overlap_nccl``: the share of the communication the backward pass hides;
9. ``two_ranks`` *, ``two_rank_algorithms`` *, ``skipped_collective`` *, ``device_stall`` *:
   two ranks on the one GPU (NCCL over sockets, a host id per rank): collectives and every
   Bagua algorithm across them, a collective one rank skips (StallError at its deadline), a
   collective stuck on the device (NCCLTimeoutError at its deadline);
   ``one_rank_deadline`` *: the device deadline with one rank.

Exit status: 0 when every required part passed (or, in a dry run, was skipped), 1 when one
failed, 2 without a GPU. ``--cpu-dry-run`` runs everything on the CPU, skipping what needs
CUDA: for working on this script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
NO_GPU = "gpu_check: no GPU (torch.cuda.is_available() is False); nothing to check"
PASS, FAIL, SKIP = "pass", "fail", "skip"
DEFAULT_BUDGET_S = 450.0
MIN_PART_S = 20.0
"""A part is not started with less time than this left in the budget."""
LOG_TAIL_LINES = 40

NCCL_ONE_RANK = {"BAGUAHVD_NCCL_SINGLE_RANK": "1"}
TWO_RANKS_ON_ONE_GPU = {
    # Each rank appends its local rank (gpu_check_ranks.py), so NCCL sees two hosts.
    "NCCL_HOSTID": "gpu-check",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
}
FAILURE_EXIT = {"BAGUAHVD_EXIT_TIMEOUT_SECONDS": "5"}


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the check: what runs, how long it may take and how to read its result.

    Attributes:
        name: the part's name (``--only``, file names).
        number: the part's number in the module docstring's list.
        title: one line for the summary.
        kind: ``worker`` (a gpu_check_*.py script that writes a result file) or ``pytest``
            (a pytest run read from its JUnit XML).
        argv: the command after the Python executable; ``{result}`` and ``{device}`` are
            filled in.
        ranks: torchrun's ranks; 0 runs the command as a plain process.
        required: whether its failure fails the check.
        env: settings added to the environment.
        timeout_s: the part's own time limit.
        nccl_ranks: the size of the NCCL communicator its log must show being created
            (NCCL_DEBUG=INFO); None when no NCCL communicator is expected.
        clean_exit: whether the process must exit with status 0 (parts that end their job
            through a failure on purpose exit otherwise).
    """

    name: str
    number: str
    title: str
    kind: str
    argv: tuple[str, ...]
    ranks: int = 0
    required: bool = True
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    timeout_s: float = 90.0
    nccl_ranks: int | None = None
    clean_exit: bool = True


def _worker(script: str, part: str) -> tuple[str, ...]:
    return (f"benchmarks/{script}", "--part", part, "--result", "{result}",
            "--device", "{device}")


def _engine_parts(part: str, number: str, title: str, timeout_s: float) -> list[Part]:
    """The part as it is (identity fast path) and through a one-rank NCCL communicator."""
    argv = _worker("gpu_check_engine.py", part)
    return [
        Part(part, number, f"{title} (one rank, identity fast path)", "worker", argv, ranks=1,
             env={"NCCL_DEBUG": "INFO"}, timeout_s=timeout_s),
        Part(f"{part}_nccl", number, f"{title} (one rank through NCCL)", "worker", argv,
             ranks=1, env={**NCCL_ONE_RANK, "NCCL_DEBUG": "INFO"}, timeout_s=timeout_s,
             nccl_ranks=1),
    ]


PARTS: tuple[Part, ...] = (
    Part("versions", "1", "library versions, GPU and driver", "worker",
         _worker("gpu_check_env.py", "versions"), timeout_s=45),
    Part("cuda_tests", "2", "pytest -m cuda tests", "pytest",
         ("-m", "pytest", "-m", "cuda", "tests", "-q", "-p", "no:cacheprovider", "--timeout=60",
          "--continue-on-collection-errors", "--junitxml={result}"), timeout_s=150),
    *_engine_parts("collectives", "3", "collectives against a CPU oracle", 75),
    *_engine_parts("stream_order", "4", "a delayed producer on a side stream", 60),
    *_engine_parts("optimizer", "5", "DistributedOptimizer against the CPU", 60),
    *_engine_parts("algorithms", "6", "every Bagua algorithm", 90),
    Part("kernels", "7", "kernels against the torch oracle; bandwidth vs a copy", "worker",
         _worker("gpu_check_kernels.py", "kernels"), timeout_s=90),
    Part("overlap_nccl", "8", "communication hidden behind backward (one rank through NCCL)",
         "worker", _worker("gpu_check_overlap.py", "overlap"), ranks=1,
         env={**NCCL_ONE_RANK, "NCCL_DEBUG": "INFO"}, timeout_s=90, nccl_ranks=1),
    Part("cuda_tests_one_rank", "2b",
         "tests/parallel/test_cuda.py as one torchrun rank through NCCL", "pytest",
         ("-m", "pytest", "tests/parallel/test_cuda.py", "-q", "-p", "no:cacheprovider",
          "--timeout=60", "--junitxml={result}"), ranks=1, required=False,
         env={**NCCL_ONE_RANK, "BAGUAHVD_TEST_WORKER": "1"}, timeout_s=120),
    Part("two_ranks", "9", "two ranks on one GPU: collectives across them", "worker",
         _worker("gpu_check_ranks.py", "two_ranks"), ranks=2, required=False,
         env={**TWO_RANKS_ON_ONE_GPU, "NCCL_DEBUG": "INFO"}, timeout_s=90, nccl_ranks=2),
    Part("two_rank_algorithms", "9", "two ranks on one GPU: every Bagua algorithm",
         "worker", _worker("gpu_check_ranks.py", "two_rank_algorithms"), ranks=2,
         required=False, env={**TWO_RANKS_ON_ONE_GPU, "NCCL_DEBUG": "INFO"}, timeout_s=120,
         nccl_ranks=2),
    Part("skipped_collective", "9", "two ranks: one skips a collective (StallError)",
         "worker", _worker("gpu_check_ranks.py", "skipped_collective"), ranks=2,
         required=False,
         env={**TWO_RANKS_ON_ONE_GPU, **FAILURE_EXIT, "HOROVOD_STALL_CHECK_TIME_SECONDS": "2",
              "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5", "BAGUAHVD_NCCL_TIMEOUT_SECONDS": "5"},
         timeout_s=75, clean_exit=False),
    Part("device_stall", "9", "two ranks: a collective stuck on the device (NCCLTimeoutError)",
         "worker", _worker("gpu_check_ranks.py", "device_stall"), ranks=2, required=False,
         env={**TWO_RANKS_ON_ONE_GPU, **FAILURE_EXIT, "BAGUAHVD_NCCL_TIMEOUT_SECONDS": "5",
              "NCCL_DEBUG": "INFO"},
         timeout_s=75, nccl_ranks=2, clean_exit=False),
    Part("one_rank_deadline", "9", "one rank: a collective stuck on the device times out",
         "worker", _worker("gpu_check_ranks.py", "one_rank_deadline"), ranks=1,
         required=False,
         env={**NCCL_ONE_RANK, **FAILURE_EXIT, "BAGUAHVD_NCCL_TIMEOUT_SECONDS": "3",
              "NCCL_DEBUG": "INFO"},
         timeout_s=60, nccl_ranks=1, clean_exit=False),
)


# -- running one part ----------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """What one part found."""

    name: str
    number: str
    title: str
    required: bool
    status: str = SKIP
    error: str = ""
    elapsed_s: float = 0.0
    timeout_s: float = 0.0
    exit_code: int | None = None
    command: str = ""
    log: str = ""
    log_tail: str = ""
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)


def command_of(part: Part, python: str, result: pathlib.Path, device: str) -> list[str]:
    """The part's command line: its arguments filled in, under torchrun when it has ranks
    (torchrun runs a script, or a module after ``-m``)."""
    argv = [a.format(result=result, device=device) for a in part.argv]
    if part.ranks:
        return [python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={part.ranks}", *argv]
    return [python, *argv]


def child_env(part: Part) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(part.env)
    return env


def run_process(argv: Sequence[str], env: Mapping[str, str], timeout_s: float,
                log: pathlib.Path) -> tuple[int | None, bool]:
    """Runs ``argv`` from the repository root in a session of its own, its output into
    ``log``; on timeout stops the whole session (torchrun's ranks included).

    Returns:
        (exit status, whether it timed out).
    """
    with open(log, "wb") as stream:
        process = subprocess.Popen(list(argv), cwd=ROOT, env=dict(env), stdout=stream,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        try:
            code: int | None = process.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            code = None
        _stop_session(process)
    return code, timed_out


def _stop_session(process: subprocess.Popen[bytes]) -> None:
    """Ends whatever is left of the session that ``process`` leads (ranks torchrun left
    behind, or all of it after a timeout): TERM, five seconds, then KILL."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        process.poll()
        try:
            os.killpg(process.pid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.1)
    else:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def tail(path: pathlib.Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_NCCL_INIT = re.compile(r"NCCL INFO .*\bnranks (\d+)\b.*Init COMPLETE")
_NCCL_WARN = re.compile(r"NCCL WARN .*")
_DUPLICATE_GPU = re.compile(r"Duplicate GPU detected[^\n]*")


def nccl_from_log(text: str) -> dict[str, Any]:
    """What NCCL_DEBUG=INFO said: the size of every communicator created, and warnings."""
    return {
        "communicator_sizes": [int(m) for m in _NCCL_INIT.findall(text)],
        "warnings": [m.group(0)[:300] for m in _NCCL_WARN.finditer(text)][:10],
    }


def read_worker_results(result: pathlib.Path, outcome: Outcome) -> None:
    """Loads the result files of every rank (``result``, ``result.rank1``, ...) into
    ``outcome``; a worker that wrote none leaves it without checks."""
    files = sorted(result.parent.glob(result.name + "*"))
    for path in [f for f in files if not f.name.endswith(".tmp")]:
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            outcome.warnings.append(f"unreadable result file {path.name}: {exc}")
            continue
        prefix = "" if body.get("rank", 0) == 0 else f"rank{body['rank']}."
        for check in body.get("checks", []):
            check["name"] = prefix + check["name"]
            outcome.checks.append(check)
        for key, value in body.get("data", {}).items():
            outcome.data[prefix + key] = value
        outcome.warnings.extend(prefix + w for w in body.get("warnings", []))


def read_junit(path: pathlib.Path, outcome: Outcome) -> None:
    """Loads a pytest JUnit XML file into ``outcome``: the counts, and every test that
    failed as a check. A run that wrote none (it timed out) leaves the outcome as it is."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, "0"))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    outcome.data["counts"] = counts
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            found = case.find(kind)
            if found is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
                message = (found.get("message") or found.text or "").strip()
                outcome.checks.append({"name": name, "status": FAIL, "elapsed_s": float(
                    case.get("time", "0") or 0), "detail": kind, "error": message[:1000]})


def judge(part: Part, outcome: Outcome, code: int | None, timed_out: bool,
          dry_run: bool) -> None:
    """Sets the outcome's status and error from its checks, exit status and log."""
    log_text = pathlib.Path(outcome.log).read_text(errors="replace") if outcome.log else ""
    if part.env.get("NCCL_DEBUG") or part.nccl_ranks:
        outcome.data["nccl"] = nccl_from_log(log_text)
    statuses = [c["status"] for c in outcome.checks]
    counts: dict[str, int] = outcome.data.get("counts", {})
    problems = []
    if timed_out:
        problems.append(f"timed out after {outcome.timeout_s:g} s")
    elif part.kind == "pytest":
        if code == 5 and not dry_run:
            problems.append("pytest ran no test")
        elif code not in (0, 5):
            problems.append(f"pytest exited with {code}")
    elif not outcome.checks:
        problems.append(f"the worker wrote no result (exit status {code})")
    elif part.clean_exit and code != 0 and FAIL not in statuses:
        problems.append(f"every check passed but the process exited with {code}")
    if part.nccl_ranks and not dry_run:
        sizes = outcome.data["nccl"]["communicator_sizes"]
        error = "" if part.nccl_ranks in sizes else (
            f"no NCCL communicator of {part.nccl_ranks} rank(s) was created (sizes seen: "
            f"{sizes}): the CUDA tensors did not go through NCCL")
        outcome.checks.append({
            "name": "nccl_communicator", "status": FAIL if error else PASS, "elapsed_s": 0.0,
            "detail": f"NCCL_DEBUG=INFO shows communicators of sizes {sizes}", "error": error,
        })
    failed = [c for c in outcome.checks if c["status"] == FAIL]
    duplicate = _DUPLICATE_GPU.search(log_text)
    if duplicate and part.ranks > 1:
        outcome.status = SKIP
        outcome.error = f"NCCL refused two ranks on one GPU: {duplicate.group(0)}"
    elif problems or failed:
        outcome.status = FAIL
        first = [f"{c['name']}: {c['error']}" for c in failed[:3]]
        outcome.error = "; ".join(problems + first) + (
            f" (+{len(failed) - 3} more failed checks)" if len(failed) > 3 else "")
    elif statuses and all(s == SKIP for s in statuses):
        outcome.status = SKIP
        outcome.error = outcome.checks[0].get("detail", "")
    elif part.kind == "pytest" and counts.get("tests", 0) == counts.get("skipped", 0):
        outcome.status = SKIP
        outcome.error = "every test was skipped" if counts.get("tests") else "no test ran"
    else:
        outcome.status = PASS
    if outcome.status != PASS:
        outcome.log_tail = tail(pathlib.Path(outcome.log)) if outcome.log else ""


def run_part(part: Part, python: str, out: pathlib.Path, device: str, timeout_s: float,
             dry_run: bool) -> Outcome:
    outcome = Outcome(part.name, part.number, part.title, part.required, timeout_s=timeout_s)
    logs = out / "gpu_check_logs"
    suffix = "xml" if part.kind == "pytest" else "json"
    result = logs / f"{part.name}.result.{suffix}"
    for stale in logs.glob(f"{part.name}.result.*"):
        stale.unlink()
    log = logs / f"{part.name}.log"
    argv = command_of(part, python, result, device)
    outcome.command = " ".join(argv)
    outcome.log = str(log)
    started = time.monotonic()
    code, timed_out = run_process(argv, child_env(part), timeout_s, log)
    outcome.elapsed_s = round(time.monotonic() - started, 1)
    outcome.exit_code = code
    if part.kind == "pytest":
        read_junit(result, outcome)
    else:
        read_worker_results(result, outcome)
    judge(part, outcome, code, timed_out, dry_run)
    return outcome


# -- the summary -------------------------------------------------------------------------


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return lines


def _is_rows(value: Any) -> bool:
    """Whether ``value`` is a table: a list of dicts."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def markdown(summary: Mapping[str, Any]) -> str:
    """The summary as Markdown: a table of the parts, then each part's checks and data."""
    lines = [
        "# baguahvd GPU check",
        "",
        f"- started {summary['started']}, took {summary['elapsed_s']} s "
        f"(budget {summary['budget_s']:g} s)",
        f"- device: {summary['device']}" + (" (**CPU dry run**)" if summary["dry_run"] else ""),
        f"- exit status **{summary['exit_status']}**: {summary['verdict']}",
        "",
        "| # | part | required | status | time (s) | error |",
        "|---|---|---|---|---|---|",
    ]
    for part in summary["parts"]:
        lines.append(
            f"| {part['number']} | `{part['name']}`: {part['title']} | "
            f"{'yes' if part['required'] else 'no'} | **{part['status']}** | "
            f"{part['elapsed_s']} | {_cell(part['error'][:300])} |"
        )
    for part in summary["parts"]:
        lines += ["", f"## {part['number']}. `{part['name']}`: {part['status']}", ""]
        if part["error"]:
            lines += [f"Error: {part['error']}", ""]
        counts: dict[str, int] = {}
        for check in part["checks"]:
            counts[check["status"]] = counts.get(check["status"], 0) + 1
        if part["checks"]:
            lines += ["Checks: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), ""]
            shown = part["checks"]
            if len(shown) > 40:
                shown = [c for c in shown if c["status"] != PASS]
                lines += [f"{len(part['checks']) - len(shown)} passing checks are listed in "
                          "gpu_check.json only.", ""]
            if shown:
                lines += _table([{"check": c["name"], "status": c["status"],
                                  "s": c.get("elapsed_s", ""),
                                  "detail / error": (c.get("error") or c.get("detail", ""))[:400]}
                                 for c in shown])
        scalars = {k: v for k, v in part["data"].items() if not _is_rows(v)}
        if scalars:
            lines += ["", *_table([{"data": f"`{k}`", "value": v} for k, v in scalars.items()])]
        for key, value in part["data"].items():
            if _is_rows(value):
                lines += ["", f"`{key}`:", "", *_table(value)]
        if part["warnings"]:
            lines += ["", "Warnings logged by baguahvd:", ""]
            lines += [f"- {_cell(w)}" for w in part["warnings"][:10]]
        if part["log_tail"]:
            lines += ["", f"End of `{part['log']}`:", "", "```", part["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def write_summary(out: pathlib.Path, summary: Mapping[str, Any]) -> None:
    for name, text in (("gpu_check.json", json.dumps(summary, indent=1, default=str)),
                       ("gpu_check.md", markdown(summary))):
        temporary = out / f"{name}.tmp"
        temporary.write_text(text)
        os.replace(temporary, out / name)


def exit_status(outcomes: Sequence[Outcome]) -> int:
    return 1 if any(o.required and o.status == FAIL for o in outcomes) else 0


# -- main ----------------------------------------------------------------------------------


def gpu_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def device_name(dry_run: bool) -> str:
    if dry_run:
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(0))


def default_out() -> pathlib.Path:
    out = os.environ.get("OUT")
    return pathlib.Path(out) if out else BENCHMARKS / "results" / "gpu_check"


def select(only: str | None, skip_optional: bool) -> list[Part]:
    """The parts to run, required ones first; ``only`` is a comma-separated list of names."""
    parts = list(PARTS)
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        known = {p.name for p in PARTS}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"gpu_check: unknown part(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        parts = [p for p in parts if p.name in names]
    if skip_optional:
        parts = [p for p in parts if p.required]
    return [p for p in parts if p.required] + [p for p in parts if not p.required]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="folder of the summary and logs (default: $OUT, else "
                             "benchmarks/results/gpu_check)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole run (default {DEFAULT_BUDGET_S:g})")
    parser.add_argument("--only", help="comma-separated part names to run")
    parser.add_argument("--skip-optional", action="store_true", help="required parts only")
    parser.add_argument("--list", action="store_true", help="list the parts and exit")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run on the CPU, skipping what needs CUDA (no GPU needed)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter of the parts (default: this one)")
    args = parser.parse_args(argv)
    parts = select(args.only, args.skip_optional)
    if args.list:
        for part in parts:
            print(f"{part.number:>3} {part.name:<22} {'required' if part.required else 'optional'}"
                  f"  {part.timeout_s:>4g} s  {part.title}")
        return 0
    if not args.cpu_dry_run and not gpu_available():
        print(NO_GPU)
        return 2
    out: pathlib.Path = args.out or default_out()
    (out / "gpu_check_logs").mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.cpu_dry_run else "cuda"
    started = time.monotonic()
    summary: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(args.cpu_dry_run),
        "dry_run": args.cpu_dry_run,
        "budget_s": args.budget,
        "root": str(ROOT),
        "parts": [],
    }
    outcomes: list[Outcome] = []
    for part in parts:
        left = args.budget - (time.monotonic() - started)
        if left < MIN_PART_S:
            outcome = Outcome(part.name, part.number, part.title, part.required,
                              status=FAIL if part.required else SKIP,
                              error=f"not run: {left:.0f} s left of the {args.budget:g} s budget")
        else:
            print(f"gpu_check: {part.name} ({part.title}) ...", flush=True)
            outcome = run_part(part, args.python, out, device, min(part.timeout_s, left),
                               args.cpu_dry_run)
        print(f"gpu_check: {part.name}: {outcome.status} in {outcome.elapsed_s} s"
              + (f": {outcome.error[:300]}" if outcome.error else ""), flush=True)
        outcomes.append(outcome)
        order = sorted(outcomes, key=lambda o: [p.name for p in PARTS].index(o.name))
        status = exit_status(outcomes)
        summary.update(
            elapsed_s=round(time.monotonic() - started, 1),
            exit_status=status,
            verdict=("every required part passed" if status == 0
                     else "a required part failed"),
            parts=[dataclasses.asdict(o) for o in order],
        )
        write_summary(out, summary)
    status = exit_status(outcomes)
    print(f"gpu_check: summary in {out / 'gpu_check.md'} and {out / 'gpu_check.json'}")
    print(f"gpu_check: exit status {status} ({summary.get('verdict', 'nothing ran')})")
    return status


if __name__ == "__main__":
    sys.exit(main())
