"""bench/bench_compile_step.py on the tiny model on a CPU: both steps timed per bucket, compared bitwise, probed."""
from __future__ import annotations

import json
import re

import pytest

from bench import bench_compile_step, bench_gpu

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.slow  # an inductor compilation per bucket: C++ builds on a CPU
def test_it_times_the_compiled_loop_against_the_step_and_compares_every_step(capsys, tmp_path) -> None:
    assert bench_gpu.main(["--compile", "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "40",
                           "--clients", "2", "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"(\d+) row\(s\): graphs [\d.]+ ms/step \([\d.]+ tokens/s\), compiled\+graphs [\d.]+ ms/step "
                       r"\([\d.]+ tokens/s\), [\d.]+x; first call \(compile and capture\) [\d.]+ s vs [\d.]+ s; logits "
                       r"(bitwise|MISMATCH \((\d+)/41 steps bitwise, max \|diff\| [\d.e+-]+\))", out)
    assert [int(rows) for rows, *_ in lines] == [1, 2]
    assert "probe, captured vs eager (compiled step): not run: no CUDA graphs on a CPU" in out
    assert re.search(r"probe, compiled step vs the model's forward: (bitwise|MISMATCH: .+) \([\d.]+ s\)", out)
    written = json.loads((tmp_path / "out.json").read_text())
    assert [row["rows"] for row in written["by_rows"]] == [1, 2] and written["context"] == 40
    for row, (_, verdict, bitwise_steps) in zip(written["by_rows"], lines):
        assert row["steps"] == 41 and row["bitwise_steps"] == (41 if verdict == "bitwise" else int(bitwise_steps))
        assert row["replays"] == {"graphs": 41, "compiled": 41}  # every step through the buckets (eager on a CPU)


def test_a_bucket_compiled_past_the_limit_is_skipped(capsys) -> None:
    # No compile finishes within 0 s: the first bucket reports it and nothing more is timed or probed.
    assert bench_compile_step.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "2",
                                    "--compile-limit-s", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"  1 row\(s\): compiled skipped: compiling and capturing the compiled loop for 1 row\(s\) took "
                     r"\d+ s, over --compile-limit-s 0", out)
    assert " 16 row(s)" not in out and "probe, compiled step vs the model's forward: not run" in out
