"""What the compose stack's images need where no registry can be reached: a stand-in base image, a local
torch index, a Redis image from Debian's package; then every image compose.yaml names, from the Dockerfile."""
from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import yaml

from tests.deploy.docker_engine import CACHE_DIR, docker

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "kvboost-test/python:3.11-bookworm"  # stands in for python:3.11-slim (Dockerfile's PYTHON_IMAGE)
BASE_PACKAGES = "python3.11,python3-pip,python3-venv,python-is-python3,ca-certificates"
TORCH_VERSION = "2.13.0"
INDEX_PORT = 38461  # the local torch index's port (serving_index says why one port)
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# What building every image from nothing takes on the engine's disk and in the cache dir (measured: the base
# image 0.6 GB, inference 2.1 GB, the others 0.3-0.4 GB each with shared layers, the torch wheels 0.2 GB,
# and the build's intermediate containers), with room to spare; below it the builds would fill the disk
# and fail every later test that writes a file.
BUILD_NEEDS_GB = 10.0
REDIS_DOCKERFILE = f"""FROM {BASE_IMAGE}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*
WORKDIR /data
"""


def image_exists(name: str) -> bool:
    return docker("image", "inspect", name, check=False).returncode == 0


def image_id(name: str) -> str | None:
    done = docker("image", "inspect", "--format", "{{.Id}}", name, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def disk_shortfall(needed_gb: float = BUILD_NEEDS_GB) -> str | None:
    """Why the image builds cannot run here (too little free disk for the engine or the cache dir), or None."""
    root = docker("info", "--format", "{{.DockerRootDir}}").stdout.strip() or "/var/lib/docker"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    for what, path in (("the Docker engine's data root", root), ("the image cache dir", str(CACHE_DIR))):
        free_gb = shutil.disk_usage(path).free / 1e9
        if free_gb < needed_gb:
            return (f"{what} ({path}) has {free_gb:.1f} GB free; building the stack's images needs about "
                    f"{needed_gb:.0f} GB (docker image prune, or free space on that disk)")
    return None


def ensure_base_image() -> str:
    """Debian bookworm with Python 3.11, as a local image; the root filesystem tarball is cached."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    tarball = CACHE_DIR / "python3.11-bookworm-rootfs.tar"
    if not tarball.exists():
        _bootstrap_rootfs(tarball)
    docker("import", str(tarball), BASE_IMAGE)
    return BASE_IMAGE


def _bootstrap_rootfs(tarball: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="kvboost-rootfs-") as directory:
        rootfs = Path(directory) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(rootfs),
                        debian_mirror()], check=True, capture_output=True, timeout=1200)
        # pip inside the images verifies TLS against the host's bundle (it may hold a proxy's CA), and installs
        # into the system interpreter as python:3.11-slim allows.
        shutil.copyfile(HOST_CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
        (rootfs / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True, timeout=600)
        partial.rename(tarball)


def debian_mirror() -> str:
    """The Debian mirror apt already uses here (deb822 or one-line sources), else deb.debian.org."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        text = path.read_text() if path.is_file() else ""
        match = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.MULTILINE) or re.search(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)\s+bookworm\b", text, re.MULTILINE)
        if match:
            return match.group(1)
    return "http://deb.debian.org/debian"


def build_torch_index() -> Path:
    """A PEP 503 index (simple/<project>/) of the CPU torch wheel and its dependencies, under the cache dir."""
    index = CACHE_DIR / f"torch-{TORCH_VERSION}-index"
    if (index / "simple" / "torch").is_dir():
        return index
    wheels = CACHE_DIR / "torch-wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.11",
                    "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", str(wheels),
                    f"torch=={TORCH_VERSION}"], check=True, timeout=1800)
    staging = index.with_name(index.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    for wheel in wheels.glob("*.whl"):
        project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        folder = staging / "simple" / project
        folder.mkdir(parents=True, exist_ok=True)
        os.link(wheel, folder / wheel.name)
    for folder in (staging / "simple").iterdir():
        links = "".join(f'<a href="{wheel.name}">{wheel.name}</a>\n' for wheel in sorted(folder.glob("*.whl")))
        (folder / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    staging.rename(index)
    return index


@contextlib.contextmanager
def serving_index(index: Path) -> Iterator[str]:
    """Serves the index on 127.0.0.1 (builds run with --network host); yields its /simple URL.

    On one port every run where it is free: the URL is the TORCH_INDEX_URL build argument, part of the cache key
    of the inference stage's layers from its torch install on, so a new port each run would reinstall torch and
    every dependency in every build."""
    handler = functools.partial(_QuietHandler, directory=str(index))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
    except OSError:  # taken: any free port (the build then misses the layer cache from there)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        pass


def build_project_images(torch_index_url: str, compose_file: Path = ROOT / "compose.yaml") -> dict[str, str]:
    """Builds every Dockerfile target compose.yaml names, tagged as it names them; returns image -> target."""
    services = yaml.safe_load(compose_file.read_text())["services"]
    targets = {service["image"]: service["build"]["target"] for service in services.values() if "build" in service}
    for image, target in targets.items():
        previous = image_id(image)
        docker("build", "--network", "host", "--target", target, "--tag", image,
               "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}", "--build-arg", f"TORCH_INDEX_URL={torch_index_url}",
               str(ROOT), timeout=1800, env={**os.environ, "DOCKER_BUILDKIT": "0"})
        if previous is not None and previous != image_id(image):
            # The tag moved: the image it named (2 GB for inference) would stay behind, untagged, every run.
            # A container still using it keeps it (rmi refuses), which is fine.
            docker("rmi", previous, check=False)
    return targets


def build_redis_image(compose_file: Path = ROOT / "compose.yaml") -> str:
    """Debian's redis-server on the base image, tagged as compose.yaml's redis service names its image."""
    image = yaml.safe_load(compose_file.read_text())["services"]["redis"]["image"]
    if not image_exists(image):
        with tempfile.TemporaryDirectory(prefix="kvboost-redis-") as context:
            (Path(context) / "Dockerfile").write_text(REDIS_DOCKERFILE)
            docker("build", "--network", "host", "--tag", image, context, timeout=900,
                   env={**os.environ, "DOCKER_BUILDKIT": "0"})
    return image


def image_size_mb(image: str) -> float:
    return int(docker("image", "inspect", "--format", "{{.Size}}", image).stdout) / 1e6


def prepare_images() -> dict[str, str]:
    """Everything `docker compose up` and the l2 profile need, built locally; returns image -> target."""
    ensure_base_image()
    with serving_index(build_torch_index()) as url:
        targets = build_project_images(url)
    targets[build_redis_image()] = "redis (Debian's redis-server)"
    return targets
