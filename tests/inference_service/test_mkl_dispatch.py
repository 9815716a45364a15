"""MKL's dispatch: which CPUs get the library, that it builds and loads before torch, that it changes which kernel
runs (on a non-Intel CPU), and that this test process runs the references under what a default service runs."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inference_service import mkl_dispatch
from inference_service.serving.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
HAS_COMPILER = mkl_dispatch.shutil.which("cc") is not None or mkl_dispatch.shutil.which("gcc") is not None
NON_INTEL_X86 = mkl_dispatch.wants_features("auto")[0]


def test_auto_gives_the_library_to_non_intel_x86_cpus_only() -> None:
    assert mkl_dispatch.wants_features("auto", "x86_64", "AuthenticAMD")[0]
    assert mkl_dispatch.wants_features("auto", "x86_64", "HygonGenuine")[0]
    assert not mkl_dispatch.wants_features("auto", "x86_64", "GenuineIntel")[0]
    assert not mkl_dispatch.wants_features("auto", "aarch64", "")[0]
    assert mkl_dispatch.wants_features("features", "x86_64", "GenuineIntel")[0]
    assert not mkl_dispatch.wants_features("vendor", "x86_64", "AuthenticAMD")[0]
    with pytest.raises(ValueError, match="--mkl-dispatch must be one of"):
        mkl_dispatch.wants_features("fast", "x86_64", "AuthenticAMD")


def test_the_cpu_vendor_is_read_from_cpuinfo() -> None:
    assert mkl_dispatch.cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n") == "AuthenticAMD"
    assert mkl_dispatch.cpu_vendor("processor\t: 0\nCPU implementer\t: 0x41\n") == ""


def test_the_flag_is_read_from_a_command_line_before_the_parser_runs() -> None:
    assert mkl_dispatch.asked_in(["--model", "x", "--mkl-dispatch", "vendor"]) == "vendor"
    assert mkl_dispatch.asked_in(["--mkl-dispatch=features"]) == "features"
    assert mkl_dispatch.asked_in(["--threads", "2"]) is None


def test_the_service_refuses_an_unknown_dispatch_naming_the_choices(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--mkl-dispatch", "fast"], environ={})
    assert "--mkl-dispatch" in capsys.readouterr().err
    assert parse_config([], environ={"KVBOOST_MKL_DISPATCH": "vendor"}).mkl_dispatch == "vendor"


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler (cc or gcc) on this machine to build the library")
def test_the_library_builds_once_and_answers_that_the_cpu_is_intel(tmp_path) -> None:
    path = mkl_dispatch.build(tmp_path)
    assert path == mkl_dispatch.library_path(tmp_path) and path.exists()
    stamp = path.stat().st_mtime_ns
    assert mkl_dispatch.build(tmp_path) == path and path.stat().st_mtime_ns == stamp  # built once
    library = ctypes.CDLL(str(path))
    assert library.mkl_serv_intel_cpu_true() == 1 and library.mkl_serv_intel_cpu() == 1


def run_python(code: str, env_dispatch: str | None = None) -> subprocess.CompletedProcess:
    env = {**mkl_dispatch.os.environ}
    env.pop(mkl_dispatch.ENV, None)
    if env_dispatch:
        env[mkl_dispatch.ENV] = env_dispatch
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_features_asked_after_torch_is_imported_is_refused_and_auto_says_why_it_kept_mkls_choice() -> None:
    result = run_python("""
        import torch
        from inference_service import mkl_dispatch
        try:
            mkl_dispatch.apply("features")
        except RuntimeError as error:
            print("refused:", error)
        mkl_dispatch._applied = None
        print("auto:", mkl_dispatch.apply("auto").describe())
    """)
    assert result.returncode == 0, result.stderr
    assert "refused: torch was imported before the dispatch could be set" in result.stdout
    if NON_INTEL_X86:
        assert "auto: vendor (torch was imported before" in result.stdout


PRODUCT = """
    from inference_service import mkl_dispatch
    dispatch = mkl_dispatch.apply()
    import hashlib, torch
    torch.manual_seed(0)
    weight, x = torch.randn(4096, 576), torch.randn(1, 576)
    print(dispatch.applied, hashlib.sha256(torch.nn.functional.linear(x, weight).numpy().tobytes()).hexdigest())
"""


@pytest.mark.skipif(not (NON_INTEL_X86 and HAS_COMPILER),
                    reason="MKL already picks kernels by instruction set on Intel (and off x86-64 it is not MKL); "
                           "or no C compiler to build the library")
def test_on_a_non_intel_cpu_features_runs_another_kernel_than_mkls_own_choice() -> None:
    # Otherwise the identity tests under `features` would prove nothing about it.
    features = run_python(PRODUCT, "features")
    vendor = run_python(PRODUCT, "vendor")
    assert features.returncode == 0 and vendor.returncode == 0, features.stderr + vendor.stderr
    assert features.stdout.split()[0] == "features" and vendor.stdout.split()[0] == "vendor"
    assert features.stdout.split()[1] != vendor.stdout.split()[1]


def test_this_test_process_runs_the_references_under_the_dispatch_a_default_service_gets() -> None:
    from tests.conftest import MKL_DISPATCH

    assert mkl_dispatch.current() is MKL_DISPATCH
    service = run_python("""
        from inference_service import mkl_dispatch
        print(mkl_dispatch.apply().applied)
    """, env_dispatch=mkl_dispatch.os.environ.get(mkl_dispatch.ENV))
    assert service.returncode == 0, service.stderr
    assert service.stdout.strip() == MKL_DISPATCH.applied


SWEEP_KINDS = ("llama", "qwen2")


@pytest.fixture(scope="module")
def wide_sweeps(tmp_path_factory):
    """Both families' sweeps (bench/bench_mkl_dispatch.py), started together on first use, on one torch thread
    each (as the identity tests run; both dispatches of a family alike): each runs its two dispatch processes one
    after the other, so the two families share the machine's two cores instead of waiting on each other (at
    torch's default thread count, two processes would oversubscribe the cores and crawl). {kind: (process, its
    JSON path)}; killed if a test ends early."""
    folder = tmp_path_factory.mktemp("mkl-sweeps")
    sweeps = {kind: (subprocess.Popen([sys.executable, str(ROOT / "bench" / "bench_mkl_dispatch.py"), "--model",
                                       f"tiny-{kind}", "--prompts", "200", "--tokens", "64", "--threads", "1",
                                       "--json", str(folder / f"{kind}.json")],
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                     folder / f"{kind}.json")
              for kind in SWEEP_KINDS}
    try:
        yield sweeps
    finally:
        for process, _ in sweeps.values():
            if process.returncode is None:  # not waited for by its test
                process.kill()
                process.communicate()


@pytest.mark.slow
@pytest.mark.skipif(not (NON_INTEL_X86 and HAS_COMPILER),
                    reason="MKL already picks kernels by instruction set on Intel (and off x86-64 it is not MKL); "
                           "or no C compiler to build the library")
@pytest.mark.parametrize("kind", SWEEP_KINDS)
def test_features_gives_the_greedy_tokens_of_mkls_own_dispatch_on_a_wide_sweep(kind, wide_sweeps) -> None:
    # The roundings differ (the test above); the tokens must not: 200 chat prompts x 64 tokens of plain
    # model.generate in a process on each dispatch (bench/bench_mkl_dispatch.py; SmolLM2's sweep is in
    # docs/performance.md).
    process, out = wide_sweeps[kind]
    stdout, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [runs[name]["dispatch"] for name in ("vendor", "features")] == ["vendor", "features"]
    assert len(runs["vendor"]["outputs"]) == 200 and all(runs["vendor"]["outputs"])  # every prompt answered
    assert runs["features"]["outputs"] == runs["vendor"]["outputs"], stdout
