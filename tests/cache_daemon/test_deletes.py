"""A Store whose writer computed its chunks before a Delete does not bring back what the Delete removed: the
DeleteLog alone, then over gRPC with a Delete completed and with one still running."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
from kvboost.v1 import cache_pb2

from cache_daemon.deletes import DeleteLog, WriterEpoch
from tests.daemon_support import (NAMESPACE, cache_stub, digest, hold_key_deletes, make_chunk, rpc_error, running_daemon,
                                  store_frames)

OTHER_NAMESPACE = digest("another namespace")


def finished(log: DeleteLog, owner: str | None = None, namespace: bytes | None = None, keys=()) -> None:
    log.end(log.begin(owner, namespace, keys))


def test_a_writer_that_saw_a_delete_stores_and_one_that_did_not_leaves_out_only_what_it_named() -> None:
    log = DeleteLog()
    before = WriterEpoch(log.epoch_id, log.count_seen_by(None))
    finished(log, keys=[b"k1"])
    finished(log, namespace=OTHER_NAMESPACE)
    after = WriterEpoch(log.epoch_id, log.count_seen_by(None))
    assert after.count == before.count + 2
    assert log.supersedes(before, NAMESPACE, b"k1")  # named by key
    assert log.supersedes(before, OTHER_NAMESPACE, b"k2")  # named by namespace
    assert not log.supersedes(before, NAMESPACE, b"k2")  # named by neither
    assert not log.supersedes(after, NAMESPACE, b"k1") and not log.supersedes(after, OTHER_NAMESPACE, b"k2")
    assert not log.supersedes(None, NAMESPACE, b"k1")  # no epoch: stored as before


def test_a_running_delete_supersedes_every_writer_and_a_corrupted_blobs_delete_names_nothing() -> None:
    log = DeleteLog()
    now = WriterEpoch(log.epoch_id, 0)
    running = log.begin(None, keys=[b"k1"])
    assert log.supersedes(now, NAMESPACE, b"k1") and log.count_seen_by(None) == 0  # not counted until it ends
    log.end(running)
    assert log.supersedes(now, NAMESPACE, b"k1") and not log.supersedes(WriterEpoch(log.epoch_id, 1), NAMESPACE, b"k1")
    finished(log)  # a corrupted blob's Delete: counted, names nothing (a good copy may come back)
    assert not log.supersedes(WriterEpoch(log.epoch_id, 1), NAMESPACE, b"k1") and log.count_seen_by(None) == 2


def test_an_epoch_that_cannot_be_checked_supersedes() -> None:
    log = DeleteLog(max_remembered=2)
    assert log.supersedes(WriterEpoch("another start", 0), NAMESPACE, b"k")
    assert log.supersedes(WriterEpoch(log.epoch_id, 1), NAMESPACE, b"k")  # a count this start never reached
    for _ in range(3):
        finished(log, keys=[b"elsewhere"])
    assert log.supersedes(WriterEpoch(log.epoch_id, 0), NAMESPACE, b"k")  # older than the Deletes remembered
    assert not log.supersedes(WriterEpoch(log.epoch_id, 1), NAMESPACE, b"k")  # the last two are remembered


def test_the_deletes_remembered_are_bounded_by_their_keys_too() -> None:
    log = DeleteLog(max_keys=3)
    oldest = WriterEpoch(log.epoch_id, 0)
    finished(log, keys=[b"a", b"b"])
    after_first = WriterEpoch(log.epoch_id, 1)
    finished(log, keys=[b"c", b"d"])  # 4 keys remembered: the first Delete goes
    assert log.supersedes(oldest, NAMESPACE, b"unnamed")  # its epoch can no longer be checked
    assert log.supersedes(after_first, NAMESPACE, b"c") and not log.supersedes(after_first, NAMESPACE, b"a")


def test_a_tenants_count_holds_its_own_and_the_admins_deletes_only() -> None:
    log = DeleteLog()
    alice = WriterEpoch(log.epoch_id, log.count_seen_by("alice"), "alice")
    finished(log, "bob", keys=[b"bob's"])
    finished(log, "bob", keys=[b"bob's"])
    assert log.count_seen_by("alice") == 0 and log.count_seen_by("bob") == 2 and log.count_seen_by(None) == 2
    assert not log.supersedes(alice, NAMESPACE, b"alice's")  # Bob's Deletes are not in Alice's count
    finished(log, "alice", keys=[b"alice's"])
    finished(log, None, keys=[b"admin named"])
    assert log.supersedes(alice, NAMESPACE, b"alice's") and log.supersedes(alice, NAMESPACE, b"admin named")
    seen = WriterEpoch(log.epoch_id, log.count_seen_by("alice"), "alice")
    assert seen.count == 2 and not log.supersedes(seen, NAMESPACE, b"alice's")


def lookup(stub, keys) -> cache_pb2.LookupReply:
    return stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys))


def store(stub, chunks, epoch: cache_pb2.LookupReply | None) -> cache_pb2.StoreReply:
    meta = {} if epoch is None else {"delete_epoch_id": epoch.delete_epoch_id, "delete_count": epoch.delete_count}
    return stub.Store(iter(store_frames(chunks, **meta)))


def test_a_write_back_computed_before_a_delete_does_not_store_its_chunks_again(tmp_path: Path) -> None:
    with running_daemon(tmp_path / "lmdb") as daemon, cache_stub(daemon.address) as stub:
        named, other = make_chunk("named by the delete"), make_chunk("not named")
        assert store(stub, [named], None).stored == 1
        computed_after = lookup(stub, [named.key, other.key])  # the writer's Lookup: one hit, one miss to compute
        stub.Delete(cache_pb2.DeleteRequest(keys=[named.key]))
        late = store(stub, [named, other], computed_after)  # its write-back arrives after the Delete
        assert (late.stored, late.superseded) == (1, 1)
        assert list(lookup(stub, [named.key, other.key]).prefix_hit) == [False, True]
        fresh = lookup(stub, [named.key])  # a writer that saw the Delete stores it again
        assert (store(stub, [named], fresh).stored, lookup(stub, [named.key]).prefix_run) == (1, 1)
        # Without an epoch (a warm-up, an older client) a Store is stored as it always was.
        stub.Delete(cache_pb2.DeleteRequest(namespace=NAMESPACE))
        assert store(stub, [named], None).stored == 1
        # An epoch not of this start, or a count without its id, cannot be checked.
        assert store(stub, [other], cache_pb2.LookupReply(delete_epoch_id="0" * 16)).superseded == 1
        assert daemon.cache.stats().counters.superseded == 2  # /metrics: kvboost_cache_superseded_total
        error = rpc_error(stub.Store, iter(store_frames([other], delete_count=3)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "delete_epoch_id" in error.details()


def test_a_store_that_meets_a_delete_still_removing_is_left_out(tmp_path: Path) -> None:
    """The Delete begins before it removes anything, and a Store is checked inside LMDB's write lock: however the
    two interleave, the chunk is not held once both have returned."""
    with running_daemon(tmp_path / "lmdb") as daemon, cache_stub(daemon.address) as stub:
        chunk = make_chunk("deleted while its write-back arrives")
        epoch = lookup(stub, [chunk.key])
        removing, finish = hold_key_deletes(daemon)
        deleting = threading.Thread(target=stub.Delete, args=(cache_pb2.DeleteRequest(keys=[chunk.key]),))
        deleting.start()
        assert removing.wait(10)
        reply = store(stub, [chunk], epoch)  # the writer's epoch is still the current one: the Delete has not ended
        finish.set()
        deleting.join(10)
        assert (reply.stored, reply.superseded) == (0, 1)
        deadline = time.monotonic() + 10
        while lookup(stub, [chunk.key]).delete_count == epoch.delete_count and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lookup(stub, [chunk.key]).prefix_run == 0
