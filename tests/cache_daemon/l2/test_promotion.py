"""ArrivingKeys and the promotion's batches and deadlines (pure, no Redis)."""
from __future__ import annotations

import threading
import time

from cache_daemon.entry import ChunkKey
from cache_daemon.l2.promotion import (PROMOTE_FIXED_S, PROMOTE_FLOOR_BYTES_PER_S, ArrivingKeys,
                                       promotion_deadline_s, sized_batches)


def key(index: int) -> ChunkKey:
    return ChunkKey(bytes([index]) * 32)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_deadline_grows_with_the_bytes():
    assert promotion_deadline_s(0) == PROMOTE_FIXED_S
    assert promotion_deadline_s(77 << 20) == PROMOTE_FIXED_S + (77 << 20) / PROMOTE_FLOOR_BYTES_PER_S


def test_batches_are_bounded_by_chunks_and_by_bytes_in_order():
    sized = [(key(i), size) for i, size in enumerate([10, 10, 10, 50, 10, 200, 10])]
    # max 3 chunks, max 60 bytes: [0,1,2] (3 chunks), [3,4] (60 bytes), [5] (alone, larger than the bound), [6]
    assert [[k[0] for k in batch] for batch in sized_batches(sized, 3, 60)] == [[0, 1, 2], [3, 4], [5], [6]]
    assert list(sized_batches([], 3, 60)) == []


def test_a_key_is_claimed_once_and_released_by_its_promotion():
    arriving = ArrivingKeys(FakeClock())
    assert arriving.claim([key(1), key(2), key(1)], deadline=110.0) == [key(1), key(2)]
    # A second Lookup of the same keys while they arrive: reported too, but promoted by the first one only.
    assert arriving.claim([key(2), key(3)], deadline=110.0) == [key(3)]
    assert arriving.arriving([key(1), key(4)]) == {key(1)}
    arriving.release([key(1), key(2), key(3)])
    assert len(arriving) == 0 and not arriving.wait(key(1))


def test_a_reader_waits_until_the_key_is_released():
    arriving = ArrivingKeys()
    arriving.claim([key(1)], deadline=time.monotonic() + 3600)
    waited = []
    reader = threading.Thread(target=lambda: waited.append(arriving.wait(key(1))))
    reader.start()
    reader.join(0.05)
    assert reader.is_alive(), "the reader must wait while the key arrives"
    arriving.release([key(1)])
    reader.join(5)
    assert waited == [True]


def test_a_reader_stops_waiting_at_the_deadline():
    clock = FakeClock()
    arriving = ArrivingKeys(clock)
    arriving.claim([key(1)], deadline=clock.now - 1)  # its promotion's deadline has passed
    assert arriving.wait(key(1)) is True  # returns at once; the caller reads LMDB again and finds a miss
    assert arriving.wait_all(0) is False
