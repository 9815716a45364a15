"""bench/bench_invariant_sweep.py on the tiny model on a CPU in bf16: the invariant path bitwise on every path, and
the variant path's mismatches reported (so the comparison can fail)."""
from __future__ import annotations

import json

import pytest

from bench import bench_invariant_sweep

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARGS = ["--shape", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--prompts", "16", "--words", "40", "400"]


def test_the_invariant_path_is_bitwise_everywhere_and_the_variant_path_is_not(tmp_path, capsys) -> None:
    assert bench_invariant_sweep.main(ARGS + ["--json", str(tmp_path / "invariant.json")]) == 0
    invariant = json.loads((tmp_path / "invariant.json").read_text())
    paths = {"daemon", "l0", "uncached, batched", "l0, batched"}
    assert paths <= set(invariant["paths"]) and invariant["total"] >= 16 * len(paths)
    assert invariant["bitwise"] == invariant["total"], invariant["paths"]
    assert bench_invariant_sweep.main(ARGS + ["--variant", "--json", str(tmp_path / "variant.json")]) == 0
    variant = json.loads((tmp_path / "variant.json").read_text())
    assert variant["total"] == invariant["total"]
    if variant["bitwise"] == variant["total"]:
        pytest.skip("this CPU's bf16 kernels round the variant path's pieces alike: the negative control has no "
                    "rounding to show here (the invariant sweep above still ran)")
    assert "MISMATCH in" in capsys.readouterr().out
