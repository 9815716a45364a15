"""The replay ring: bounded, by sequence."""
import pytest

from kvboost_common.kv_events.replay_ring import ReplayRing


def test_since_returns_kept_batches_from_start():
    ring = ReplayRing(3)
    for sequence in range(5):  # 0 and 1 fall out
        ring.append(sequence, bytes([sequence]))
    assert len(ring) == 3
    assert ring.since(0) == [(2, b"\x02"), (3, b"\x03"), (4, b"\x04")]
    assert ring.since(3) == [(3, b"\x03"), (4, b"\x04")]
    assert ring.since(5) == []


def test_sequences_must_follow_each_other():
    ring = ReplayRing(2)
    ring.append(7, b"")
    with pytest.raises(AssertionError, match="does not follow"):
        ring.append(9, b"")
