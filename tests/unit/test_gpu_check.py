"""The GPU check (``benchmarks/gpu_check.sh`` and its Python parts) without a GPU: it refuses
in one line with status 2, its scripts parse, and the driver's summary logic works on made-up
results. A CPU dry run of two parts exercises the plumbing (torchrun, workers, summary)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import py_compile
import shutil
import subprocess
import sys
from types import ModuleType

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_check.sh"
DRIVER = BENCHMARKS / "gpu_check.py"
WORKERS = ("gpu_check_env.py", "gpu_check_engine.py", "gpu_check_kernels.py",
           "gpu_check_overlap.py", "gpu_check_ranks.py")
NO_GPU = "gpu_check: no GPU (torch.cuda.is_available() is False); nothing to check"

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", **extra}


@pytest.fixture(scope="module")
def driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", DRIVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_script_is_valid_executable_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.parametrize("name", ["gpu_check.py", "gpu_check_common.py", *WORKERS])
def test_the_python_parts_compile(name: str, tmp_path: pathlib.Path) -> None:
    py_compile.compile(str(BENCHMARKS / name), cfile=str(tmp_path / "out.pyc"), doraise=True)


@needs_no_gpu
@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_script_refuses_without_a_gpu_in_one_line() -> None:
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True,
                            env=_env(), timeout=120)
    assert result.returncode == 2
    assert result.stdout.splitlines() == [NO_GPU]
    assert result.stderr == ""


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_script_says_why_when_python_cannot_run() -> None:
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True,
                            env=_env(PYTHON="/nonexistent/python3"), timeout=60)
    assert result.returncode == 2
    assert result.stdout.splitlines() == [
        "gpu_check: /nonexistent/python3 cannot run; nothing to check"
    ]


@needs_no_gpu
def test_the_driver_refuses_without_a_gpu_in_one_line() -> None:
    result = subprocess.run([sys.executable, str(DRIVER)], capture_output=True, text=True,
                            env=_env(), timeout=120)
    assert result.returncode == 2
    assert result.stdout.splitlines() == [NO_GPU]


def test_the_driver_lists_its_parts(driver: ModuleType) -> None:
    result = subprocess.run([sys.executable, str(DRIVER), "--list"], capture_output=True,
                            text=True, env=_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    listed = [line.split()[1] for line in result.stdout.splitlines()]
    assert sorted(listed) == sorted(part.name for part in driver.PARTS)
    assert len(set(listed)) == len(listed)


@pytest.mark.parametrize("name", WORKERS)
def test_each_worker_imports_and_parses_its_arguments(name: str) -> None:
    env = _env(PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(BENCHMARKS / name), "--help"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--part" in result.stdout


def test_every_part_names_a_part_its_worker_has(driver: ModuleType) -> None:
    for part in driver.PARTS:
        if part.kind == "worker":
            script = next(a for a in part.argv if a.endswith(".py"))
            source = (ROOT / script).read_text()
            worker_part = part.argv[part.argv.index("--part") + 1]
            assert f'"{worker_part}"' in source, (part.name, script)


def test_nccl_communicators_are_read_from_the_log(driver: ModuleType) -> None:
    log = (
        "host:1:2 [0] NCCL INFO ncclCommInitRank comm 0x55 rank 0 nranks 1 cudaDev 0 "
        "nvmlDev 0 busId 1b000 commId 0x12 - Init COMPLETE\n"
        "host:1:2 [0] NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA "
        "device 1b000\n"
        "host:1:2 [0] NCCL INFO ncclCommInitRankConfig comm 0x56 rank 1 nranks 2 cudaDev 0 "
        "nvmlDev 0 busId 1b000 commId 0x13 localSize 1 used 0 bytes - Init COMPLETE\n"
    )
    found = driver.nccl_from_log(log)
    assert found["communicator_sizes"] == [1, 2]
    assert len(found["warnings"]) == 1 and "Duplicate GPU" in found["warnings"][0]


def _outcome(driver: ModuleType, tmp_path: pathlib.Path, log: str,
             checks: list[dict[str, object]]) -> object:
    path = tmp_path / "part.log"
    path.write_text(log)
    outcome = driver.Outcome("p", "3", "title", True, log=str(path), timeout_s=10.0)
    outcome.checks = checks
    return outcome


def _check(name: str, status: str) -> dict[str, object]:
    return {"name": name, "status": status, "elapsed_s": 0.0, "detail": "", "error": ""}


def test_a_part_meant_for_nccl_fails_without_an_nccl_communicator(
    driver: ModuleType, tmp_path: pathlib.Path
) -> None:
    part = next(p for p in driver.PARTS if p.name == "collectives_nccl")
    outcome = _outcome(driver, tmp_path, "no nccl here\n", [_check("init", "pass")])
    driver.judge(part, outcome, 0, False, dry_run=False)
    assert outcome.status == "fail"
    assert "did not go through NCCL" in outcome.error
    assert outcome.log_tail == "no nccl here"


def test_two_ranks_that_nccl_refuses_are_a_skip(driver: ModuleType,
                                                tmp_path: pathlib.Path) -> None:
    part = next(p for p in driver.PARTS if p.name == "two_ranks")
    log = "NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000\n"
    outcome = _outcome(driver, tmp_path, log, [_check("allreduce", "fail")])
    driver.judge(part, outcome, 1, False, dry_run=False)
    assert outcome.status == "skip"
    assert outcome.error.startswith("NCCL refused two ranks on one GPU")


def test_a_timeout_fails_the_part_and_keeps_its_checks(driver: ModuleType,
                                                       tmp_path: pathlib.Path) -> None:
    part = next(p for p in driver.PARTS if p.name == "kernels")
    outcome = _outcome(driver, tmp_path, "", [_check("compiled", "pass")])
    driver.judge(part, outcome, None, True, dry_run=False)
    assert outcome.status == "fail" and "timed out after 10 s" in outcome.error
    assert [c["name"] for c in outcome.checks] == ["compiled"]


def test_pytest_counts_and_failures_come_from_junit(driver: ModuleType,
                                                    tmp_path: pathlib.Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.unit.test_k" name="test_a" time="0.1"/>'
        '<testcase classname="tests.unit.test_k" name="test_b" time="0.2">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.unit.test_k" name="test_c"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    outcome = driver.Outcome("cuda_tests", "2", "t", True)
    driver.read_junit(xml, outcome)
    assert outcome.data["counts"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                      "passed": 1}
    assert [c["name"] for c in outcome.checks] == ["tests.unit.test_k::test_b"]
    assert outcome.checks[0]["error"] == "assert 1 == 2"


def test_only_a_failed_required_part_fails_the_check(driver: ModuleType) -> None:
    def outcome(required: bool, status: str) -> object:
        return driver.Outcome("p", "1", "t", required, status=status)

    assert driver.exit_status([outcome(True, "pass"), outcome(False, "fail")]) == 0
    assert driver.exit_status([outcome(True, "skip"), outcome(True, "pass")]) == 0
    assert driver.exit_status([outcome(True, "fail"), outcome(False, "pass")]) == 1


def test_unknown_part_names_are_refused_with_the_known_ones(driver: ModuleType) -> None:
    with pytest.raises(SystemExit, match="unknown part.*nope.*known: .*kernels"):
        driver.select("kernels,nope", skip_optional=False)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_a_cpu_dry_run_writes_one_summary(tmp_path: pathlib.Path) -> None:
    result = subprocess.run(
        [sys.executable, str(DRIVER), "--cpu-dry-run", "--only", "versions,collectives",
         "--out", str(tmp_path), "--budget", "200"],
        capture_output=True, text=True, env=_env(PYTHONPATH=str(ROOT)), timeout=300,
    )
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = {part["name"]: part for part in summary["parts"]}
    assert set(parts) == {"versions", "collectives"}
    assert parts["collectives"]["status"] == "pass", parts["collectives"]["error"]
    assert any(c["name"].startswith("allreduce.bfloat16") for c in parts["collectives"]["checks"])
    assert result.returncode == summary["exit_status"] == 0, result.stdout + result.stderr
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| 3 | `collectives`" in markdown and "CPU dry run" in markdown
