"""Which of MKL's kernels torch's float32 products run on this CPU; set before torch is imported.

torch's CPU wheels link Intel MKL (2024.2 in the pinned torch). MKL picks its kernels by CPU vendor first: on
Intel it runs the AVX2/AVX-512 kernel the CPU supports; on any other x86-64 CPU it falls back to generic kernels
unless its internal `mkl_serv_intel_cpu_true()` answers 1, so an AMD CPU with AVX-512 runs the one-row float32
product several times slower than it could (measured in docs/performance.md, "MKL on a non-Intel CPU").

`features` loads a tiny shared library that defines that function (and its sibling `mkl_serv_intel_cpu()`,
which MKL asks before it spreads a one-row product over threads), with RTLD_GLOBAL, before torch loads
MKL, so MKL chooses by instruction set as it does on Intel. It changes which kernel runs, not what is computed:
every float32 product still is MKL's, the same for the engine and for plain transformers in the same process,
so greedy output stays token-identical to `model.generate` under the same dispatch (every identity test checks
exactly that: tests/conftest.py applies the same choice before torch is imported). Against a process left on
the generic kernels the roundings differ; bench/bench_mkl_dispatch.py measures how often greedy tokens do.

`auto` (the default) is `features` on a non-Intel x86-64 Linux CPU and `vendor` (do nothing) elsewhere.
The library is compiled once with the system C compiler (`cc`) into KVBOOST_NATIVE_DIR (default
~/.cache/kvboost/native); without a compiler `auto` keeps MKL's choice and says so.

No torch import here (python -m inference_service.mkl_dispatch --build runs in an image's build stage).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

CHOICES = ("auto", "features", "vendor")
ENV = "KVBOOST_MKL_DISPATCH"
NATIVE_DIR_ENV = "KVBOOST_NATIVE_DIR"

SOURCE = """\
/* KVBoost-gRPC: MKL asks these whether the CPU is Intel before it picks kernels by instruction set (the first)
   and before it runs a one-row product on more than one thread (the second). */
int mkl_serv_intel_cpu_true(void) { return 1; }
int mkl_serv_intel_cpu(void) { return 1; }
"""
LIBRARY_NAME = "libkvboost_mkl_cpu_features.so"


@dataclass(frozen=True, slots=True)
class Dispatch:
    asked: str  # auto, features or vendor
    applied: str  # features or vendor: what MKL in this process does
    reason: str  # one line for the start-up log

    def describe(self) -> str:
        return f"{self.applied} ({self.reason})"


_applied: Dispatch | None = None


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The x86 vendor string (GenuineIntel, AuthenticAMD, ...), or '' where there is none to read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


def wants_features(asked: str, machine: str | None = None, vendor: str | None = None) -> tuple[bool, str]:
    """Whether `asked` means loading the library here, and why (or why not)."""
    if asked not in CHOICES:
        raise ValueError(f"--mkl-dispatch must be one of {CHOICES}, got {asked!r}")
    machine = platform.machine() if machine is None else machine
    vendor = cpu_vendor() if vendor is None else vendor
    if asked == "vendor":
        return False, "asked: MKL picks its kernels by CPU vendor"
    if machine not in ("x86_64", "AMD64") or not sys.platform.startswith("linux"):
        return False, f"MKL's vendor check is an x86-64 Linux matter; this is {machine} {sys.platform}"
    if asked == "auto" and vendor == "GenuineIntel":
        return False, "an Intel CPU: MKL already picks kernels by instruction set"
    return True, f"{vendor or 'unknown vendor'}: MKL picks kernels by instruction set, as on Intel"


def native_dir() -> Path:
    configured = os.environ.get(NATIVE_DIR_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvboost" / "native"


def library_path(directory: Path | None = None) -> Path:
    """Where the compiled library of this SOURCE lives (its hash in the folder name: a changed source rebuilds)."""
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    return (native_dir() if directory is None else directory) / digest / LIBRARY_NAME


def build(directory: Path | None = None) -> Path:
    """Compiles SOURCE with `cc` (or $CC) unless already built; atomic, so concurrent starts do not clash."""
    target = library_path(directory)
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC) to build the MKL dispatch library; install gcc "
                                "(apt-get install gcc) or start with --mkl-dispatch vendor")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        source = Path(scratch) / "mkl_cpu_features.c"
        source.write_text(SOURCE)
        built = Path(scratch) / LIBRARY_NAME
        result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(source)],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} could not build the MKL dispatch library: {result.stderr.strip()}")
        os.replace(built, target)
    return target


def apply(asked: str | None = None) -> Dispatch:
    """Sets MKL's dispatch for this process; call before anything imports torch. Idempotent: a second call
    returns the first one's result (a process has one dispatch)."""
    global _applied
    if _applied is not None:
        return _applied
    asked = asked or os.environ.get(ENV) or "auto"
    features, reason = wants_features(asked)
    if not features:
        _applied = Dispatch(asked, "vendor", reason)
        return _applied
    if "torch" in sys.modules:
        problem = "torch was imported before the dispatch could be set (MKL has chosen already)"
        if asked == "features":
            raise RuntimeError(problem)
        _applied = Dispatch(asked, "vendor", problem)
        return _applied
    try:
        path = build()
        ctypes.CDLL(str(path), mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        if asked == "features":
            raise RuntimeError(f"--mkl-dispatch features: {error}") from error
        _applied = Dispatch(asked, "vendor", f"generic kernels kept: {error}")
        return _applied
    _applied = Dispatch(asked, "features", reason)
    return _applied


def current() -> Dispatch | None:
    """What apply() set in this process, or None if it was never called."""
    return _applied


def asked_in(argv: Sequence[str]) -> str | None:
    """The --mkl-dispatch value in a command line, read before the full parser runs (it must act before torch)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--mkl-dispatch", choices=CHOICES)
    known, _ = parser.parse_known_args(list(argv))
    return known.mkl_dispatch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference_service.mkl_dispatch",
        description="Build (--build) or show the MKL dispatch library; see this module's docstring.")
    parser.add_argument("--build", action="store_true", help=f"compile the library into {NATIVE_DIR_ENV} "
                        "(default ~/.cache/kvboost/native) and print its path")
    args = parser.parse_args(argv)
    if args.build:
        print(build())
        return 0
    features, reason = wants_features("auto")
    print(f"auto here: {'features' if features else 'vendor'} ({reason}); library {library_path()}"
          f"{'' if library_path().exists() else ' (not built)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
