"""hack/images.sh's cheap parts: the image names it builds are the ones the manifests run, and the
Dockerfiles leave pip alone for Docker users. (Building the images is the e2e tier's job.)"""

import re
import subprocess
from pathlib import Path

import yaml

from goodput_operator.settings import DEFAULT_RUNTIME_IMAGE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "images.sh"


def _names() -> list[str]:
    result = subprocess.run([str(SCRIPT), "names"], capture_output=True, text=True, timeout=30, check=True)
    return result.stdout.split()


def _manifest_images() -> tuple[str, str]:
    for doc in yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text()):
        if doc and doc.get("kind") == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            return container["image"], env["RUNTIME_IMAGE"]
    raise AssertionError("no Deployment in manifests/operator.yaml")


def test_the_script_builds_the_images_the_manifests_run():
    base, runtime, operator = _names()
    operator_in_manifest, runtime_in_manifest = _manifest_images()
    assert base.startswith("localhost/")
    assert operator == operator_in_manifest
    assert runtime == runtime_in_manifest == DEFAULT_RUNTIME_IMAGE


def test_a_wrong_command_is_a_usage_error_that_touches_nothing():
    for args in (["bogus"], ["build", "bogus"], ["import", "--containerd-socket"], []):
        result = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=30)
        assert result.returncode == 2, args
        assert "images: usage:" in result.stderr
        assert result.stdout == ""


def test_the_pip_build_args_have_no_default_so_docker_builds_use_pip_as_usual():
    for dockerfile in ("Dockerfile.runtime", "Dockerfile.operator"):
        text = (ROOT / dockerfile).read_text()
        for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"):
            assert re.search(rf"^ARG {name}$", text, re.M), (dockerfile, name)
        assert re.search(r"^ARG BASE_IMAGE=\S+$", text, re.M), dockerfile


def test_every_path_a_dockerfile_copies_is_in_the_build_context():
    # .dockerignore keeps everything out but what it names with "!": a COPY of anything else fails the build
    allowed = {line[1:].strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for dockerfile in ROOT.glob("Dockerfile.*"):
        for source in re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s+\S+\s*$", dockerfile.read_text(), re.MULTILINE):
            top = source.removeprefix("./").split("/")[0]
            assert top in allowed, f"{dockerfile.name} copies {source}, which .dockerignore leaves out"
