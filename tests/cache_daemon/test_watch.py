"""WatchEvents over a real gRPC server in this process: events, cursors, lost and snapshots, tenants, floods."""
from __future__ import annotations

import json
import struct
import time
import urllib.request

import grpc
import pytest
from kvboost.v1 import cache_pb2
from prometheus_client.parser import text_string_to_metric_families

from cache_daemon.events import ChunkEvent, EventBatch, EventKind
from cache_daemon.tenancy import KeySpace
from cache_daemon.watch import MAX_SNAPSHOT_PAGE, EventView, event_batch, snapshot_page_size
from tests.conftest import pick_free_port
from tests.daemon_support import (NAMESPACE, SampleChunk, cache_stub, digest, header_frame, make_chunk, running_daemon,
                                  store_chunks)
from tests.event_support import EventStream, KeyView
from tests.redis_support import redis_node, requires_redis

OTHER_NAMESPACE = digest("another model")
FIRST_CONNECT = cache_pb2.WatchEventsRequest()
TOKENS = {"alice": "alice-token", "bob": "bob-token", "ops": "ops-token"}


def held_keys(daemon) -> set[tuple[str, bytes, bytes]]:
    """What the daemon holds, read from its LMDB directly (tenancy off: keys as stored, no tenant)."""
    return {("", entry.namespace, key) for key, entry, _ in daemon.cache.held_chunks(b"", 1 << 20)}


def continuation_frames(chunk: SampleChunk, parent: bytes, tokens: list[int]) -> list[cache_pb2.ChunkFrame]:
    return [header_frame(chunk, parent_key=parent, token_ids=struct.pack(f"<{len(tokens)}I", *tokens)),
            cache_pb2.ChunkFrame(data=chunk.blob)]


def as_tenant(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[name]}")]


@pytest.fixture()
def daemon(tmp_path):
    with running_daemon(tmp_path / "lmdb", max_bytes=10_000) as daemon:
        yield daemon


@pytest.fixture()
def stub(daemon):
    with cache_stub(daemon.address) as stub:
        yield stub


@pytest.fixture()
def watch(stub):
    """A stream opened at first connect and synced: through its lost and its (empty) snapshot."""
    stream = EventStream(stub, FIRST_CONNECT).start_reading()
    stream.synced()
    yield stream
    stream.close()


def test_a_first_connect_is_told_the_incarnation_then_gets_a_snapshot(watch: EventStream) -> None:
    assert watch.view.lost_reasons == ["new incarnation"]
    assert (watch.view.held, watch.view.next_sequence, len(watch.view.incarnation)) == (set(), 0, 32)


def test_stored_chunks_are_watched_with_their_keys_tokens_and_parent(stub, watch: EventStream) -> None:
    first, document = make_chunk("first", 100), make_chunk("document", 100, content_key=digest("doc"), num_tokens=7)
    store_chunks(stub, [first, document])
    follow_up = make_chunk("follow-up", 100, num_tokens=2)
    stub.Store(iter(continuation_frames(follow_up, parent=first.key, tokens=[5, 6])))
    events = watch.until(lambda view: len(view.events) == 3).events
    assert [(event.sequence, event.kind, event.tier) for event in events] == \
        [(sequence, cache_pb2.KV_EVENT_STORED, cache_pb2.KV_TIER_L1) for sequence in range(3)]
    assert [(event.namespace, event.prefix_key, event.content_key, event.num_tokens, event.parent_key, event.tenant)
            for event in events] == [(NAMESPACE, first.key, b"", 16, b"", ""),
                                     (NAMESPACE, document.key, document.content_key, 7, b"", ""),
                                     (NAMESPACE, follow_up.key, b"", 2, first.key, "")]
    assert all(event.unix_time > time.time() - 60 for event in events)


def test_eviction_under_the_byte_budget_is_watched(daemon, stub, watch: EventStream) -> None:
    old = [make_chunk(f"old {index}", 3000) for index in range(3)]
    for chunk in old:  # one Store each, so old[0] is the least recently used
        store_chunks(stub, [chunk])
    newcomer = make_chunk("newcomer", 3000)  # the budget is 10,000 bytes
    assert store_chunks(stub, [newcomer]).evicted == 1
    view = watch.until(lambda view: len(view.events) == 5)
    assert [(event.kind, event.prefix_key) for event in view.events[3:]] == [
        (cache_pb2.KV_EVENT_EVICTED, old[0].key), (cache_pb2.KV_EVENT_STORED, newcomer.key)]
    assert view.held == held_keys(daemon)


def test_deletes_by_key_and_by_namespace_are_watched(daemon, stub, watch: EventStream) -> None:
    gone, kept = make_chunk("gone", 100), make_chunk("kept", 100)
    other = [make_chunk(f"other {index}", 100, namespace=OTHER_NAMESPACE) for index in range(2)]
    store_chunks(stub, [gone, kept, *other])
    stub.Delete(cache_pb2.DeleteRequest(keys=[gone.key, digest("never stored")]))
    stub.Delete(cache_pb2.DeleteRequest(namespace=OTHER_NAMESPACE))
    view = watch.until(lambda view: len(view.events) == 6)
    assert [(event.kind, event.namespace, event.prefix_key) for event in view.events[4:]] == [
        (cache_pb2.KV_EVENT_DELETED, NAMESPACE, gone.key), (cache_pb2.KV_EVENT_CLEARED, OTHER_NAMESPACE, b"")]
    assert view.held == held_keys(daemon) == {("", NAMESPACE, kept.key)}


def test_a_consumer_that_reconnects_with_its_cursor_resumes_without_gap_or_duplicate(stub) -> None:
    first = EventStream(stub, FIRST_CONNECT).start_reading()
    first.synced()
    chunks = [make_chunk(f"resume {index}", 100) for index in range(5)]
    store_chunks(stub, chunks[:3])
    view = first.until(lambda view: len(view.events) == 3)
    first.close()
    # While it is away: two more stored, one deleted.
    store_chunks(stub, chunks[3:])
    stub.Delete(cache_pb2.DeleteRequest(keys=[chunks[0].key]))
    resumed_view = KeyView(held=set(view.held), incarnation=view.incarnation, next_sequence=view.next_sequence)
    request = cache_pb2.WatchEventsRequest(incarnation=view.incarnation, from_sequence=view.next_sequence)
    second = EventStream(stub, request, view=resumed_view).start_reading()
    try:
        second.until(lambda view: len(view.events) == 3)
        assert second.drain() == 0, "nothing more: no event twice"
        assert resumed_view.lost_reasons == []
        assert [(event.sequence, event.kind) for event in resumed_view.events] == [
            (3, cache_pb2.KV_EVENT_STORED), (4, cache_pb2.KV_EVENT_STORED), (5, cache_pb2.KV_EVENT_DELETED)]
        assert resumed_view.held == {("", NAMESPACE, chunk.key) for chunk in chunks[1:]}
    finally:
        second.close()


def test_another_incarnation_gets_lost_then_a_paged_snapshot_of_exactly_the_held_keys(daemon, stub) -> None:
    chunks = [make_chunk(f"held {index}", 100) for index in range(5)]
    store_chunks(stub, chunks)
    stub.Delete(cache_pb2.DeleteRequest(keys=[chunks[2].key]))
    request = cache_pb2.WatchEventsRequest(incarnation="an earlier daemon's", from_sequence=3, snapshot_page_size=2)
    stream = EventStream(stub, request).start_reading()
    try:
        lost = stream.next_reply().lost
        assert (lost.reason, lost.resume_sequence) == ("new incarnation", 6)
        pages = [stream.next_reply().snapshot for _ in range(3)]
        assert [(len(page.entries), page.last) for page in pages] == [(2, False), (2, False), (0, True)]
        assert stream.view.held == held_keys(daemon) == {("", NAMESPACE, chunk.key) for chunk in chunks} - \
            {("", NAMESPACE, chunks[2].key)}
    finally:
        stream.close()


def test_a_cursor_behind_the_history_is_answered_lost(tmp_path) -> None:
    with running_daemon(tmp_path / "lmdb", event_history=4) as daemon, cache_stub(daemon.address) as stub:
        store_chunks(stub, [make_chunk(f"chunk {index}", 100) for index in range(10)])
        request = cache_pb2.WatchEventsRequest(incarnation=daemon.cache.events.incarnation, from_sequence=2)
        stream = EventStream(stub, request).start_reading()
        try:
            assert stream.synced().lost_reasons == ["cursor behind history"]
            assert stream.view.held == held_keys(daemon) and len(stream.view.held) == 10
        finally:
            stream.close()


def test_skip_snapshot_gets_lost_then_live_events_only(stub) -> None:
    store_chunks(stub, [make_chunk("before", 100)])
    stream = EventStream(stub, cache_pb2.WatchEventsRequest(skip_snapshot=True)).start_reading()
    try:
        assert stream.next_reply().lost.resume_sequence == 1
        after = make_chunk("after", 100)
        store_chunks(stub, [after])
        assert stream.next_reply().events.events[0].prefix_key == after.key
        assert stream.view.held == {("", NAMESPACE, after.key)}
    finally:
        stream.close()


def test_tenants_watch_their_own_events_with_their_own_keys_and_an_admin_watches_all(tmp_path) -> None:
    tenants = {"alice": {"token": TOKENS["alice"]}, "bob": {"token": TOKENS["bob"]},
               "ops": {"token": TOKENS["ops"], "admin": True}}
    (tmp_path / "tenants.json").write_text(json.dumps({"tenants": tenants}))
    with running_daemon(tmp_path / "lmdb", tenants_file=tmp_path / "tenants.json") as daemon, \
            cache_stub(daemon.address) as stub:
        alice_early = make_chunk("alice early", 100, content_key=digest("alice tokens"))
        store_chunks(stub, [alice_early], metadata=as_tenant("alice"))
        streams = {name: EventStream(stub, FIRST_CONNECT, metadata=as_tenant(name)).start_reading()
                   for name in ("alice", "ops")}
        try:
            # Snapshots follow the same rule as events: keys as alice sent them, under her name.
            assert streams["alice"].synced().held == {("alice", NAMESPACE, alice_early.key)}
            assert streams["ops"].synced().held == {("alice", NAMESPACE, alice_early.key)}
            bobs = make_chunk("bob's", 100)
            store_chunks(stub, [bobs], metadata=as_tenant("bob"))
            alice_next = make_chunk("alice next", 100, num_tokens=3)
            stub.Store(iter(continuation_frames(alice_next, parent=alice_early.key, tokens=[1, 2, 3])),
                       metadata=as_tenant("alice"))
            mine = streams["alice"].until(lambda view: len(view.events) == 1).events
            assert [(event.sequence, event.tenant, event.namespace, event.prefix_key, event.parent_key)
                    for event in mine] == [(1, "alice", NAMESPACE, alice_next.key, alice_early.key)]
            everyone = streams["ops"].until(lambda view: len(view.events) == 2).events
            assert [(event.sequence, event.tenant, event.namespace, event.prefix_key) for event in everyone] == [
                (1, "bob", NAMESPACE, bobs.key), (2, "alice", NAMESPACE, alice_next.key)]
            assert streams["alice"].drain() == 0, "bob's event never reaches alice"
            stored = {key for key, _, _ in daemon.cache.held_chunks(b"", 100)}
            assert alice_early.key not in stored, "as stored, alice's keys are permuted: the events unscope them"
        finally:
            for stream in streams.values():
                stream.close()


def test_an_admin_sees_a_removed_tenants_events_under_its_name_with_keys_as_stored() -> None:
    alice_space = KeySpace(bytes(range(32)))
    stored = ChunkEvent(EventKind.STORED, alice_space.scope(NAMESPACE), alice_space.scope(digest("k")), num_tokens=1)
    view = EventView(owner_of=lambda namespace: "alice", space_of_owner=lambda name: None)
    [event] = event_batch(view, EventBatch("incarnation", 7, [stored])).events
    assert (event.sequence, event.tenant, event.namespace, event.prefix_key) == \
        (7, "alice", stored.namespace, stored.prefix_key)


def test_snapshot_page_sizes_are_bounded() -> None:
    assert (snapshot_page_size(0), snapshot_page_size(10), snapshot_page_size(10**9)) == \
        (4096, 10, MAX_SNAPSHOT_PAGE)


def test_a_flood_that_outruns_a_stalled_consumer_is_answered_lost_and_the_resync_is_exact(tmp_path) -> None:
    metrics_port = pick_free_port()
    # No BDP probing: gRPC keeps the consumer's receive window small instead of growing it to megabytes.
    with running_daemon(tmp_path / "lmdb", max_bytes=200_000, event_history=64, metrics_port=metrics_port) as daemon, \
            cache_stub(daemon.address, options=[("grpc.http2.bdp_probe", 0)]) as stub:
        stream = EventStream(stub, FIRST_CONNECT)  # opened, never read while the flood runs
        try:
            # 3000 chunks of 100 bytes into a 200 kB budget: stored and evicted events, far more than
            # the 64 events of history and the stream's flow-control window hold. Every Store (and a
            # Lookup) completes while the watcher reads nothing.
            for start in range(0, 3000, 100):
                chunks = [make_chunk(f"flood {index}", 100) for index in range(start, start + 100)]
                assert store_chunks(stub, chunks, timeout=10).stored == 100
            lookup = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[chunks[-1].key]), timeout=10)
            assert lookup.prefix_run == 1
            stream.start_reading()
            marker = make_chunk("marker", 100)
            store_chunks(stub, [marker])
            view = stream.until(lambda view: view.in_sync and ("", NAMESPACE, marker.key) in view.held)
            assert "consumer too slow" in view.lost_reasons
            assert view.held == held_keys(daemon) and len(view.held) == 2000
            metrics = scrape(metrics_port)
            assert metrics[("kvboost_events_lost_total", "consumer too slow")] >= 1
            assert metrics[("kvboost_events_dropped_total", "")] > 0
            assert metrics[("kvboost_events_published_total", "stored")] == 3001
            assert metrics[("kvboost_events_published_total", "evicted")] == 1001
            assert metrics[("kvboost_events_watchers", "")] == 1
        finally:
            stream.close()


def scrape(metrics_port: int) -> dict[tuple[str, str], float]:
    """(sample name, its kind or reason label or "") -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
        return {(sample.name, sample.labels.get("kind") or sample.labels.get("reason", "")): sample.value
                for family in families for sample in family.samples}


def test_stopping_the_daemon_ends_open_watches_at_once(tmp_path) -> None:
    serving = running_daemon(tmp_path / "lmdb", shutdown_grace_s=30)
    daemon = serving.__enter__()
    with cache_stub(daemon.address) as stub:
        stream = EventStream(stub, FIRST_CONNECT).start_reading()
        try:
            stream.synced()
            started = time.monotonic()
        finally:
            serving.__exit__(None, None, None)  # stops the daemon while the channel stays open
        assert time.monotonic() - started < 10, "the stop waited out the 30 s grace for the open stream"
        assert stream.ended.wait(10) and stream.error is None, "the stream ended with OK, not cancelled"


@requires_redis
def test_a_lookup_that_promotes_from_l2_is_watched_as_promoted(tmp_path) -> None:
    chunks = [make_chunk(f"shared {index}", 500, content_key=digest(f"shared tokens {index}")) for index in range(2)]
    with redis_node(tmp_path / "redis") as redis, \
            running_daemon(tmp_path / "a", l2=redis.url) as host_a, \
            running_daemon(tmp_path / "b", l2=redis.url) as host_b, \
            cache_stub(host_a.address) as stub_a, cache_stub(host_b.address) as stub_b:
        store_chunks(stub_a, chunks)
        assert host_a.cache.drain_writes(10)
        stream = EventStream(stub_b, FIRST_CONNECT).start_reading()
        try:
            stream.synced()
            reply = stub_b.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[chunk.key for chunk in chunks]))
            assert reply.prefix_run == 2
            events = stream.until(lambda view: len(view.events) == 2).events
            assert [(event.kind, event.tier, event.prefix_key, event.content_key) for event in events] == [
                (cache_pb2.KV_EVENT_PROMOTED, cache_pb2.KV_TIER_L1, chunk.key, chunk.content_key) for chunk in chunks]
            assert stream.view.held == held_keys(host_b)
        finally:
            stream.close()


def test_watch_events_needs_the_bearer_token(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with running_daemon(tmp_path / "lmdb", auth_token_file=token_file) as daemon, cache_stub(daemon.address) as stub:
        stream = EventStream(stub, FIRST_CONNECT).start_reading()
        assert stream.ended.wait(10) and stream.error.code() == grpc.StatusCode.UNAUTHENTICATED
        authorized = EventStream(stub, FIRST_CONNECT, metadata=[("authorization", "Bearer s3cret")]).start_reading()
        try:
            assert authorized.synced().lost_reasons == ["new incarnation"]
        finally:
            authorized.close()
