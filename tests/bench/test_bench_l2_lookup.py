"""bench/bench_l2_lookup.py under a memory-heavy load: every Lookup of L2-only keys answers all of them (the run
stops otherwise) and both paths are timed in every round. Its p99 target lives in the benchmark, not here."""
from __future__ import annotations

import re

import pytest

from bench import bench_l2_lookup
from tests.redis_support import requires_redis

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), requires_redis]


def test_every_lookup_under_load_answers_all_its_l2_only_keys_and_both_paths_are_timed(capsys):
    assert bench_l2_lookup.main(["--rounds", "6", "--keys", "64", "--value-kib", "256", "--load", "2"]) == 0
    out = capsys.readouterr().out
    assert "64 x 256 KiB (16.0 MiB behind each Lookup), 6 rounds, 2 load processes" in out
    rows = {match[0]: [float(value) for value in match[1:]] for match in
            re.findall(r"^\| (Lookup|MGET) [^|]*\| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out, re.MULTILINE)}
    assert set(rows) == {"Lookup", "MGET"}, out
    assert all(0 < p50 <= p99 <= worst for p50, p99, worst in rows.values()), out
    assert re.search(r"Lookup p99 [\d.]+ ms against the target of 50 ms: (met|missed)", out), out

