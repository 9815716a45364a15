"""bench/bench_exactness.py on the tiny model on a CPU: every path compared, the summary, a perturbed path caught; the
sweep in bf16: the invariant path bitwise on every path, the variant path's mismatches reported."""
from __future__ import annotations

import json
import re

import pytest

from bench import bench_exactness

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cached_paths_answer_as_uncached_and_a_perturbed_path_is_a_mismatch(capsys, tmp_path) -> None:
    # L0's answers are computed with layer 0's values doubled in their prefill; every other path is the control.
    assert bench_exactness.main(["--shape", "tiny", "--device", "cpu", "--lengths", "100", "300", "--dtype", "float32",
                                 "--pieces", "64", "2048", "--perturb", "l0", "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"^\[[\d:]+\] +(\d+) ([\w-]+) +piece +(\d+) +cached +(\d+)/(\d+) \(([^)]*)\) +(.*)$", out, re.M)
    paths = ["uncached", "daemon", "l0-fill", "l0"] + (["host-fill", "host"] if bench_exactness.HAS_HOST_TIER else [])
    assert [(int(length), path, int(piece)) for length, path, piece, *_ in lines] == [
        (length, path, piece) for length in (100, 300) for piece in (64, 2048) for path in paths]
    for length, path, piece, cached, prompt, tiers, checks in lines:
        assert int(prompt) == int(length)
        assert (int(cached) == 0) == (path == "uncached"), (path, cached)
        if path in ("daemon", "l0-fill"):  # the document's K/V from the daemon's map (the question's too, l0-fill)
            assert "daemon_map" in tiers, (length, path, tiers)
        if path == "l0" and int(length) > 128:  # L0 keeps whole chunks: a prompt under one chunk has none there
            assert "l0 2" in tiers, (length, path, tiers)
        diffs = [float(d) for d in re.findall(r"max \|diff\| ([\d.e+-]+)", checks)]
        if path == "l0":  # perturbed: far beyond rounding, each of its comparisons
            assert checks.count("MISMATCH") == (1 if piece == "64" else 2) and len(diffs) == checks.count("vs uncached@")
            assert min(diffs) > 1e-4, checks
        else:  # the controls: every token identical, the logits at most float32 rounding apart
            assert "diverge" not in checks and all(d < 1e-5 for d in diffs), (length, path, checks)
    summary = re.search(r"summary: (\d+)/(\d+) bitwise .*; logits (\d+)/(\d+), tokens (\d+)/(\d+)", out)
    bitwise, total, logits, _, tokens, _ = map(int, summary.groups())
    num_cached_paths = len(paths) - 1
    assert total == 2 * (2 * num_cached_paths + num_cached_paths + 1)  # per length: same piece, across pieces
    assert bitwise == logits <= total - 2 * 3 and tokens <= total  # l0's 3 comparisons per length are not bitwise
    assert "MISMATCH in" in out
    assert re.search(r"uncached vs model.generate: 2/2 token-identical", out)
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["summary"]["checks"] == total and written["summary"]["bitwise"] == bitwise
    assert len(written["rows"]) == len(lines) and len(written["generate"]) == 2


SWEEP = ["--shape", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--sweep", "16", "--words", "40", "400"]


def test_the_invariant_path_is_bitwise_everywhere_and_the_variant_path_is_not(tmp_path, capsys) -> None:
    assert bench_exactness.main(SWEEP + ["--json", str(tmp_path / "invariant.json")]) == 0
    invariant = json.loads((tmp_path / "invariant.json").read_text())
    paths = {"daemon", "l0", "uncached, batched", "l0, batched"}
    assert paths <= set(invariant["paths"]) and invariant["total"] >= 16 * len(paths)
    assert invariant["bitwise"] == invariant["total"], invariant["paths"]
    assert bench_exactness.main(SWEEP + ["--variant", "--json", str(tmp_path / "variant.json")]) == 0
    variant = json.loads((tmp_path / "variant.json").read_text())
    assert variant["total"] == invariant["total"]
    if variant["bitwise"] == variant["total"]:
        pytest.skip("this CPU's bf16 kernels round the variant path's pieces alike: the negative control has no "
                    "rounding to show here (the invariant sweep above still ran)")
    assert "MISMATCH in" in capsys.readouterr().out
