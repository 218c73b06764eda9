"""The cluster recipes: Kubernetes MPIJob manifests and the Slurm batch script.

The MPIJob CRD cannot be fetched here, so the manifests are checked against the part of the
kubeflow.org/v2beta1 MPIJob schema they use, written out below (field names, types and
enums), and then against what baguahvd needs: a launcher whose command ``baguahvdrun``
accepts and whose ranks fit the workers' slots, workers that run the image's ssh server,
images and scripts that the Dockerfiles provide. The Slurm script's launch is built as it
would be inside the allocation its ``#SBATCH`` lines ask for.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from baguahvd.runner import cli
from baguahvd.runner.mpirun import build_command

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "examples" / "kubernetes").glob("*.yaml"))
SBATCH = ROOT / "examples" / "slurm" / "pytorch_digits.sbatch"
IMAGES = {"baguahvd:cpu": "Dockerfile.cpu", "baguahvd:cuda12": "Dockerfile.cuda12"}
"""Image tags the manifests use → the Dockerfile that builds them (docker/README.md)."""
SCRIPT_ROOTS = {"/opt/baguahvd/examples/": "Dockerfile.cpu", "/examples/": "Dockerfile.cuda12"}
"""Where each image has the examples."""

# The part of the MPIJob v2beta1 schema the recipes use: allowed keys and their types.
MPIJOB_SPEC = {
    "slotsPerWorker": int,
    "runPolicy": dict,
    "mpiReplicaSpecs": dict,
    "sshAuthMountPath": str,
    "mpiImplementation": str,
    "launcherCreationPolicy": str,
    "runLauncherAsWorker": bool,
}
RUN_POLICY = {
    "cleanPodPolicy": str,
    "ttlSecondsAfterFinished": int,
    "activeDeadlineSeconds": int,
    "backoffLimit": int,
    "schedulingPolicy": dict,
    "suspend": bool,
    "managedBy": str,
}
REPLICA_SPEC = {"replicas": int, "template": dict, "restartPolicy": str}
ENUMS = {
    "mpiImplementation": {"OpenMPI", "Intel", "MPICH"},
    "cleanPodPolicy": {"None", "Running", "All"},
    "restartPolicy": {"Always", "OnFailure", "Never", "ExitCode"},
    "launcherCreationPolicy": {"AtStartup", "WaitForWorkersReady"},
}
CONTAINER_KEYS = {
    "name", "image", "command", "args", "env", "resources", "volumeMounts",
    "securityContext", "imagePullPolicy", "workingDir", "ports",
}


def check_fields(where: str, value: Any, fields: dict[str, type]) -> None:
    assert isinstance(value, dict), f"{where} must be a mapping"
    for key, item in value.items():
        assert key in fields, f"{where}.{key} is not a field of the MPIJob schema"
        assert isinstance(item, fields[key]), f"{where}.{key} must be {fields[key].__name__}"
        if key in ENUMS:
            assert item in ENUMS[key], f"{where}.{key}={item!r} is not one of {ENUMS[key]}"


def load(path: Path) -> dict[str, Any]:
    documents = list(yaml.safe_load_all(path.read_text()))
    assert len(documents) == 1, f"{path.name} should hold one MPIJob"
    job = documents[0]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    assert job["kind"] == "MPIJob"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    assert set(job) == {"apiVersion", "kind", "metadata", "spec"}
    spec = job["spec"]
    check_fields("spec", spec, MPIJOB_SPEC)
    assert spec["slotsPerWorker"] >= 1
    check_fields("spec.runPolicy", spec.get("runPolicy", {}), RUN_POLICY)
    replicas = spec["mpiReplicaSpecs"]
    assert set(replicas) == {"Launcher", "Worker"}
    for role, replica in replicas.items():
        check_fields(f"spec.mpiReplicaSpecs.{role}", replica, REPLICA_SPEC)
        containers = replica["template"]["spec"]["containers"]
        assert isinstance(containers, list) and containers
        for container in containers:
            assert set(container) <= CONTAINER_KEYS, set(container) - CONTAINER_KEYS
            assert isinstance(container["name"], str) and isinstance(container["image"], str)
            assert all(isinstance(word, str) for word in container.get("command", []))
    assert replicas["Launcher"]["replicas"] == 1
    assert replicas["Worker"]["replicas"] >= 1
    return job


def container(job: dict[str, Any], role: str) -> dict[str, Any]:
    (found,) = job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"]
    return dict(found)


def dockerfile_user(dockerfile: str) -> str:
    text = (ROOT / "docker" / dockerfile).read_text()
    return str(re.search(r"^ARG CONTAINER_USER=(\w+)", text, re.M).group(1))  # type: ignore[union-attr]


def test_there_are_manifests_for_both_images() -> None:
    images = {container(load(path), "Worker")["image"] for path in MANIFESTS}
    assert images == set(IMAGES)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_mpijob_manifest(path: Path, tmp_path: Path) -> None:
    job = load(path)
    spec = job["spec"]
    launcher, worker = container(job, "Launcher"), container(job, "Worker")
    assert launcher["image"] == worker["image"] and launcher["image"] in IMAGES
    assert worker["command"][:2] == ["/usr/sbin/sshd", "-D"], "workers are ssh hosts"
    assert spec["mpiImplementation"] == "OpenMPI"
    # A non-root user: the operator mounts the key pair into that user's home.
    user_home = spec["sshAuthMountPath"].removesuffix("/.ssh")
    assert re.fullmatch(r"/home/\w+", user_home)
    for role in ("Launcher", "Worker"):
        context = spec["mpiReplicaSpecs"][role]["template"]["spec"]["securityContext"]
        assert context["runAsUser"] == 1000  # the Dockerfiles' USER_UID default
    assert dockerfile_user(IMAGES[launcher["image"]]) == "root", (
        "the manifests ask for a CONTAINER_USER build, documented in their header"
    )
    assert f"--build-arg CONTAINER_USER={user_home.rsplit('/', 1)[1]}" in path.read_text()

    # The launcher's command is a launch baguahvdrun accepts, with the operator's hostfile.
    command = launcher["command"]
    assert command[0] == "baguahvdrun"
    slots, workers = spec["slotsPerWorker"], spec["mpiReplicaSpecs"]["Worker"]["replicas"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(
        "".join(f"{job['metadata']['name']}-worker-{i}.svc slots={slots}\n" for i in range(workers))
    )
    args = cli.parse_args(command[1:])
    mpirun, _ = build_command(
        args, {"OMPI_MCA_orte_default_hostfile": str(hostfile)}, mpirun="mpirun"
    )
    np = int(mpirun[mpirun.index("-np") + 1])
    assert np == slots * workers, "one rank per slot"
    assert mpirun[mpirun.index("-H") + 1].count(f":{slots}") == workers

    # The script exists in that image.
    script = next(word for word in args.command if word.endswith(".py"))
    root = next(prefix for prefix in SCRIPT_ROOTS if script.startswith(prefix))
    assert SCRIPT_ROOTS[root] == IMAGES[launcher["image"]]
    assert (ROOT / "examples" / script.removeprefix(root)).exists(), script

    gpus = worker.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if launcher["image"] == "baguahvd:cuda12":
        assert gpus == slots, "one slot per GPU"
    else:
        assert gpus is None


def sbatch_options(text: str) -> dict[str, str]:
    options = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[key] = value
    return options


def test_sbatch_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    assert os.access(SBATCH, os.X_OK)
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    # sbatch stops reading #SBATCH lines at the first command.
    first_command = next(
        number for number, line in enumerate(text.splitlines())
        if line.strip() and not line.startswith("#")
    )
    assert max(
        number for number, line in enumerate(text.splitlines()) if line.startswith("#SBATCH")
    ) < first_command


def test_sbatch_launch_uses_the_allocation() -> None:
    text = SBATCH.read_text()
    options = sbatch_options(text)
    nodes, tasks = int(options["--nodes"]), int(options["--ntasks-per-node"])
    launch = re.search(r"^baguahvdrun .*?[^\\]$", text, re.M | re.S)
    assert launch is not None
    words = shlex.split(launch.group(0).replace("\\\n", " "))
    env = {
        "SLURM_JOB_NODELIST": f"node[01-{nodes:02d}]",
        "SLURM_TASKS_PER_NODE": f"{tasks}(x{nodes})",
        "SLURM_JOB_CPUS_PER_NODE": f"{tasks * int(options['--cpus-per-task'])}(x{nodes})",
    }
    command, _ = build_command(cli.parse_args(words[1:]), env, mpirun="mpirun")
    assert command[command.index("-np") + 1] == str(nodes * tasks)
    expected = ",".join(f"node{i:02d}:{tasks}" for i in range(1, nodes + 1))
    assert command[command.index("-H") + 1] == expected
    script = next(word for word in words if word.endswith(".py"))
    assert (ROOT / script).exists()


def test_examples_readme_names_the_recipes() -> None:
    readme = (ROOT / "examples" / "README.md").read_text()
    for path in [*MANIFESTS, SBATCH]:
        assert str(path.relative_to(ROOT / "examples")) in readme, path.name
