"""What the workers of ``benchmarks/gpu_check.py`` share: recording checks, comparing
tensors, and the worker's command line.

A worker runs one *part* of the GPU check (``--part NAME``) and writes what it found to a
JSON file (``--result FILE``; ranks other than 0 add ``.rank<r>``). A part is a list of
*checks*; each check is a function that returns a line of detail, raises :class:`SkipCheck`
when it cannot run here, or raises anything else to fail. The file is rewritten after every
check, so a worker killed at its part's timeout still leaves what it had found.

Workers that test the engine run under ``torchrun`` and call ``hvd.init()`` first (itself a
check); the others (versions, kernels) are plain processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

PASS, FAIL, SKIP = "pass", "fail", "skip"
STATUSES = (PASS, FAIL, SKIP)

logger = logging.getLogger("gpu_check")


class SkipCheck(Exception):
    """A check that cannot run here (no GPU in a dry run, a missing feature); the message
    says why."""


class CheckFailed(AssertionError):
    """A check found a wrong result; the message says what differed."""


def require(condition: bool, message: str) -> None:
    """Fails the running check with ``message`` unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(message)


@dataclasses.dataclass
class Check:
    """The outcome of one check."""

    name: str
    status: str
    elapsed_s: float
    detail: str = ""
    error: str = ""
    trace: str = ""


class WarningLog(logging.Handler):
    """Keeps the first warnings the ``baguahvd`` loggers emit (a kernel that fell back to
    torch, an NCCL communicator that was aborted), for the summary."""

    def __init__(self, limit: int = 20) -> None:
        super().__init__(logging.WARNING)
        self.limit = limit
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = f"{record.name}: {record.getMessage()}"[:500]
        if len(self.messages) < self.limit and message not in self.messages:
            self.messages.append(message)


class Recorder:
    """Runs the checks of one part and keeps the result file up to date.

    Args:
        part: the part's name.
        path: the JSON file to (re)write after every check; None keeps results in memory.
        rank: this process's rank (written into the file).
    """

    def __init__(self, part: str, path: str | None, rank: int = 0) -> None:
        self.part = part
        self.path = path
        self.rank = rank
        self.checks: list[Check] = []
        self.data: dict[str, Any] = {}
        """Measurements and versions, keyed by what they are; rendered in the summary."""
        self.warnings = WarningLog()
        logging.getLogger("baguahvd").addHandler(self.warnings)

    def check(self, name: str, body: Callable[[], str | None]) -> bool:
        """Runs ``body`` as the check ``name``; returns whether it passed."""
        start = time.perf_counter()
        status, detail, error, trace = PASS, "", "", ""
        try:
            detail = body() or ""
        except SkipCheck as exc:
            status, detail = SKIP, str(exc)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded, none aborts
            status, error = FAIL, describe(exc)
            trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            trace = trace[-3000:]
        self.checks.append(
            Check(name, status, round(time.perf_counter() - start, 3), detail, error, trace)
        )
        line = f"[{self.part}] {name}: {status}"
        logger.info("%s%s", line, f" ({error or detail})" if error or detail else "")
        self.write()
        return status == PASS

    def failed(self, name: str, exc: BaseException) -> None:
        """Records ``exc``, raised outside any check, as the failed check ``name``."""

        def body() -> str:
            raise exc

        self.check(name, body)

    def write(self) -> None:
        """Writes the result file (atomically: a reader never sees half of it)."""
        if self.path is None:
            return
        body = {
            "part": self.part,
            "rank": self.rank,
            "checks": [dataclasses.asdict(check) for check in self.checks],
            "data": self.data,
            "warnings": self.warnings.messages,
        }
        temporary = f"{self.path}.tmp"
        with open(temporary, "w") as stream:
            json.dump(body, stream, indent=1, default=str)
        os.replace(temporary, self.path)


def describe(exc: BaseException) -> str:
    """An exception as ``Class: message``, shortened for a summary line."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 1500 else text[:1500] + " ..."


# -- tensors ---------------------------------------------------------------------------


def tolerance(dtype: torch.dtype) -> float:
    """The relative and absolute tolerance of results of ``dtype`` that went through a
    rounding or two (scale factors, a type's own arithmetic)."""
    return {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-6}.get(dtype, 1e-12)


def compare(got: torch.Tensor, expected: torch.Tensor, tol: float | None = None) -> str:
    """Checks ``got`` (any device) against the CPU oracle ``expected``.

    Shape and dtype must match exactly; values within ``tol`` (relative and absolute;
    default: :func:`tolerance` of the dtype; 0 means bit for bit).

    Returns:
        A line with the largest difference.
    """
    require(tuple(got.shape) == tuple(expected.shape),
            f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    require(got.dtype == expected.dtype, f"dtype {got.dtype}, expected {expected.dtype}")
    host = got.detach().cpu()
    if tol is None:
        tol = tolerance(expected.dtype)
    if tol == 0:
        same = torch.equal(host, expected)
        if same:
            return "bit-identical"
    if host.numel() == 0:
        return "empty"
    difference = (host.double() - expected.double()).abs()
    worst = float(difference.max())
    limit = tol + tol * expected.double().abs()
    bad = difference > limit
    if tol == 0 or bool(bad.any()):
        index = int(torch.nonzero(difference.reshape(-1) == worst)[0]) if worst == worst else 0
        flat_got, flat_expected = host.reshape(-1), expected.reshape(-1)
        raise CheckFailed(
            f"{int(bad.sum()) if tol else int((difference != 0).sum())} of {host.numel()} "
            f"elements differ; largest |diff| {worst:g} at flat index {index}: got "
            f"{float(flat_got[index]):g}, expected {float(flat_expected[index]):g}"
        )
    return f"max |diff| {worst:g}"


def finite(values: list[float]) -> bool:
    return all(math.isfinite(value) for value in values)


def sleep_cycles_per_ms(device: torch.device) -> float:
    """How many cycles of ``torch.cuda._sleep`` take one millisecond on ``device``,
    measured with CUDA events (the GPU's clock, not its nominal rate)."""
    cycles = 20_000_000
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)  # warm-up: loads the kernel
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def needs_cuda(device: torch.device) -> None:
    """Skips the running check on a CPU dry run."""
    if device.type != "cuda":
        raise SkipCheck("needs a CUDA device (CPU dry run)")


# -- the worker's command line ------------------------------------------------------------


@dataclasses.dataclass
class WorkerArgs:
    """What a worker was asked to do."""

    part: str
    result: str
    device: torch.device


Part = Callable[[Recorder, WorkerArgs], None]


def parse_worker_args(parts: Mapping[str, Part], argv: list[str] | None = None) -> WorkerArgs:
    """Reads ``--part``, ``--result`` and ``--device`` (``cuda``, or ``cpu`` for a dry run)."""
    parser = argparse.ArgumentParser(description="one part of benchmarks/gpu_check.py")
    parser.add_argument("--part", required=True, choices=sorted(parts))
    parser.add_argument("--result", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    return WorkerArgs(args.part, args.result, torch.device(args.device))


def run_worker(parts: Mapping[str, Part], engine: bool, argv: list[str] | None = None) -> int:
    """The ``main`` of a worker script: runs the part named on the command line.

    Args:
        parts: the parts this script can run, by name.
        engine: initialise baguahvd first (``hvd.init()`` as a check of its own, then
            ``hvd.shutdown()`` at the end), pinning this rank's GPU.
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        0 when every check passed or was skipped, else 1.
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    args = parse_worker_args(parts, argv)
    rank = int(os.environ.get("RANK", "0"))
    path = args.result if rank == 0 else f"{args.result}.rank{rank}"
    recorder = Recorder(args.part, path, rank)
    recorder.write()
    if engine:
        import baguahvd.torch as hvd

        def init() -> str:
            hvd.init()
            if args.device.type == "cuda":
                # Ranks beyond the node's GPUs share the last one (two ranks on one GPU).
                local = min(hvd.local_rank(), torch.cuda.device_count() - 1)
                args.device = torch.device("cuda", local)
                torch.cuda.set_device(args.device)
            return (f"rank {hvd.rank()} of {hvd.size()}, gloo {hvd.gloo_enabled()}, "
                    f"mpi {hvd.mpi_enabled()}, device {args.device}")

        if not recorder.check("init", init):
            return 1
    try:
        parts[args.part](recorder, args)
    except Exception as exc:  # noqa: BLE001 - a part's own failure is one more check
        recorder.failed("part", exc)
    if engine:
        import baguahvd.torch as hvd

        recorder.check("shutdown", lambda: hvd.shutdown() or None)
    return 1 if any(check.status == FAIL for check in recorder.checks) else 0
