"""kvboost.v1.CacheService over grpc.aio: parse, call the cache, build the reply."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import grpc
from kvboost.v1 import cache_pb2, cache_pb2_grpc

from cache_daemon.cache import CacheStats, ChunkCache, DeleteResult, PinResult
from cache_daemon.deletes import DeleteLog
from cache_daemon.entry import ChunkKey, Entry, IncomingChunk
from cache_daemon.errors import InvalidCacheRequest, PermissionDenied, StoreStreamOverLimit
from cache_daemon.executors import DaemonExecutors
from cache_daemon.metrics import Refusals
from cache_daemon.store import BLOB_DB_VERSION
from cache_daemon.framing import (StoreStreamAssembler, check_continuation, check_continue_after_run,
                                   partial_chunk_keys, check_digest, chunk_meta, encode_data_frames,
                                  encode_header_frame)
from cache_daemon.tiered import TieredCache
from cache_daemon.tenancy import PLAIN, KeySpace, Tenancy, Tenant, current_tenant
from cache_daemon.watch import EventView, watch_events

MAX_KEYS_PER_REQUEST = 65536


@dataclass(slots=True, frozen=True)
class StoreLimits:
    """Bounds of one Store stream (held in memory until it ends): --max-store-chunks, --max-store-bytes
    (None: the budget) and --store-deadline (0: none)."""

    max_chunks: int = MAX_KEYS_PER_REQUEST
    max_bytes: int | None = None
    deadline_s: float = 120.0


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    """Lookup and Stats run on the event loop (in-memory index, plus one short LMDB read for
    content keys); blob reads, Lookups that ask L2, and every write run on separate thread pools
    (DaemonExecutors), so waiting on Redis never holds up Fetch.

    With tenancy every key, namespace and content key a tenant sends is mapped into its own key
    space on the way in (KeySpace.scope) and back on the way out, so another tenant's keys are
    plain misses: the same code path as a key never stored, which reveals nothing."""

    def __init__(self, cache: ChunkCache | TieredCache, tenancy: Tenancy | None = None, refusals: Refusals | None = None,
                 store_limits: StoreLimits | None = None, executors: DaemonExecutors | None = None) -> None:
        self._cache = cache
        self._tenancy = tenancy
        self._refusals = refusals
        self._store_limits = store_limits or StoreLimits()
        self._executors = executors or DaemonExecutors()
    def _caller(self) -> Tenant | None:
        """The calling tenant; None without tenancy (one trusted caller). Fails closed."""
        if self._tenancy is None:
            return None
        tenant = current_tenant.get()
        if tenant is None:  # the interceptor sets it on every authenticated call: never reached
            self._refuse("no tenant is attached to this call")
        return tenant

    def _space(self) -> KeySpace:
        tenant = self._caller()
        return PLAIN if tenant is None else self._tenancy.space_of(tenant)

    def _refuse(self, message: str) -> None:
        self._count_refusal("permission_denied")
        raise PermissionDenied(message)

    def _count_refusal(self, reason: str) -> None:
        if self._refusals is not None:
            self._refusals.count(reason)

    async def Lookup(self, request: cache_pb2.LookupRequest, context) -> cache_pb2.LookupReply:
        check_digest(request.namespace, "LookupRequest.namespace")
        prefix_keys = checked_keys(request.prefix_keys, "LookupRequest.prefix_keys")
        content_keys = checked_content_keys(request.content_keys, len(prefix_keys))
        partial_keys = checked_keys(request.partial_keys, "LookupRequest.partial_keys")
        check_continuation(request.continue_parent, request.continue_tokens, "LookupRequest continue_parent/tokens")
        check_continue_after_run(request.continue_after_run, len(prefix_keys), bool(request.continue_parent))
        space = self._space()
        deletes_before = self._deletes.count_seen_by(self._viewer())
        arguments = (space.scope(request.namespace), space.scope_all(prefix_keys),
                     [space.scope_optional(key) for key in content_keys], space.scope_all(partial_keys))
        result = await self._lookup(arguments)
        parent, tokens = request.continue_parent, request.continue_tokens
        reply = cache_pb2.LookupReply(
            prefix_run=result.prefix_run, prefix_hit=result.prefix_hit,
            content_hits=[cache_pb2.ContentHit(index=index, stored_key=space.unscope(key))
                          for index, key in result.content_hits],
            partial_index=result.partial_index, delete_epoch_id=self._deletes.epoch_id, delete_count=deletes_before)
        if request.continue_after_run:  # the second Lookup's question, asked of the run just found
            reply.continued = True
            run = result.prefix_run
            parent = prefix_keys[run - 1] if run else request.namespace
            tokens = request.continue_after_run[run] if run < len(request.continue_after_run) else b""
            candidates = partial_chunk_keys(parent, tokens)  # longest first
            if candidates:
                found = await self._lookup((arguments[0], [], [], space.scope_all(candidates)))
                if found.partial_index is not None:
                    reply.partial_key = candidates[found.partial_index]
                    reply.partial_tokens = len(candidates) - found.partial_index
        if parent and tokens:  # LMDB's own index: L2 records carry no continuations
            l1 = self._cache.l1 if isinstance(self._cache, TieredCache) else self._cache
            continuation = l1.continuation(arguments[0], space.scope(parent), tokens)
            if continuation is not None:
                reply.continuation_key, reply.continuation_tokens = space.unscope(continuation[0]), continuation[1]
        return reply

    @property
    def _deletes(self) -> DeleteLog:
        """The delete epoch every Lookup reply carries (LookupReply.delete_epoch_id / delete_count): Delete calls
        completed since this start that could have named the caller's chunks (a tenant: its own and the admins';
        without tenancy or as an admin: every one), so no tenant learns of another's. Read before a Lookup looks
        anything up, counted after a Delete has removed its chunks: a reply's hits were held after every Delete its
        epoch counts. A Store is checked against it too (DeleteLog.supersedes)."""
        return self._cache.deletes

    def _viewer(self) -> str | None:
        """Whose delete count the caller sees (WriterEpoch.viewer): a tenant's name, None for every Delete."""
        tenant = self._caller()
        return None if tenant is None or tenant.admin else tenant.name

    def _counted(self, remove: Callable[[], DeleteResult], owner: str | None, namespace: bytes | None,
                 keys: Sequence[bytes]) -> DeleteResult:
        """remove() on the store executor's thread, begun in the DeleteLog first (a Store checked from then on leaves
        out what it names), then counted on the same thread, found or not (NOT_FOUND included: a client tier may
        still hold what it names): once its chunks are gone, whether or not the caller is still waiting (a Delete
        past its deadline goes on removing)."""
        stone = self._deletes.begin(owner, namespace, keys)
        try:
            return remove()
        finally:
            self._deletes.end(stone)

    async def _lookup(self, arguments: tuple):
        if isinstance(self._cache, TieredCache):  # L2 behind LMDB: a round trip only for what LMDB misses
            result = self._cache.lookup_in_l1(*arguments)
            if result is None:
                result = await self._executors.run(self._executors.l2, self._lookup_with_l2, arguments)
            return result
        return self._cache.lookup(*arguments)

    def _lookup_with_l2(self, arguments: tuple) -> object:
        """A tenant's namespace gets its owner recorded first, so what L2 promotes into LMDB is charged to
        that tenant's share (and evicts within it), as a Store by the tenant would be."""
        tenant = self._caller()
        if tenant is not None:
            new_owners = self._tenancy.new_namespaces(tenant, [arguments[0]])
            if new_owners:
                self._cache.record_owners(new_owners)
                self._tenancy.record_owners(new_owners)
        return self._cache.lookup_with_l2(*arguments)

    async def Fetch(self, request: cache_pb2.FetchRequest, context) -> AsyncIterator[bytes]:
        """Yields wire-encoded ChunkFrames (the handler registers no serializer for them)."""
        keys = checked_keys(request.keys, "FetchRequest.keys")
        space = self._space()
        stored_keys = space.scope_all(keys)
        # One read ahead: the next chunk is read (and checked) in a thread while this one is sent.
        verify = not request.reader_verifies
        next_read = self._read(stored_keys[0], verify) if keys else None
        try:
            for index, key in enumerate(keys):
                chunk = await next_read
                next_read = self._read(stored_keys[index + 1], verify) if index + 1 < len(keys) else None
                if chunk is None:
                    yield encode_header_frame(cache_pb2.ChunkMeta(key=key), found=False)
                    continue
                entry, data_frames = chunk
                yield encode_header_frame(chunk_meta(key, unscoped_entry(space, entry)), found=True)
                for frame in data_frames:
                    yield frame
        finally:
            if next_read is not None:  # the stream ended early: client gone or cancelled
                next_read.cancel()

    def _read(self, key: ChunkKey, verify: bool) -> asyncio.Future:
        return asyncio.ensure_future(self._executors.run(self._executors.fetch, self._cache.read, key,
                                                         encode_data_frames, verify))

    async def Store(self, request_iterator: AsyncIterator[cache_pb2.ChunkFrame], context) -> cache_pb2.StoreReply:
        chunks = await self._received_chunks(request_iterator)
        tenant = self._caller()
        store = self._executors.store
        if tenant is not None:
            chunks = await self._executors.run(store, self._scoped_chunks, tenant, chunks)
        result = await self._executors.run(store, self._cache.put_many, chunks)
        return cache_pb2.StoreReply(stored=result.stored, already_present=result.already_present,
                                    evicted=result.evicted, bytes_stored=result.bytes_stored,
                                    superseded=result.superseded)

    async def _received_chunks(self, request_iterator: AsyncIterator[cache_pb2.ChunkFrame]) -> list[IncomingChunk]:
        """The stream's chunks, within --max-store-chunks, --max-store-bytes and --store-deadline."""
        limits = self._store_limits
        assembler = StoreStreamAssembler(self._cache.max_bytes, limits.max_chunks, limits.max_bytes or self._cache.max_bytes)
        try:
            async with asyncio.timeout(limits.deadline_s or None):
                async for frame in request_iterator:
                    assembler.feed(frame)
        except TimeoutError:
            self._count_refusal("store_deadline")
            raise StoreStreamOverLimit(f"the Store stream was still open after --store-deadline={limits.deadline_s:g} s "
                                      f"(server side) with {len(assembler.chunks)} chunks received: send fewer "
                                      f"chunks per stream, or faster") from None
        except StoreStreamOverLimit:
            self._count_refusal("store_limit")
            raise
        return assembler.finish()

    def _scoped_chunks(self, tenant: Tenant, chunks: list[IncomingChunk]) -> list[IncomingChunk]:
        """The chunks moved into the tenant's space; the owner of each new namespace recorded first
        (in LMDB too), so Stats shows a tenant its own namespaces after a restart and the chunks
        count in the tenant's share of the budget."""
        space = self._tenancy.space_of(tenant)
        scoped = [dataclasses.replace(chunk, key=ChunkKey(space.scope(chunk.key)), namespace=space.scope(chunk.namespace),
                                      content_key=space.scope_optional(chunk.content_key),
                                      parent_key=space.scope(chunk.parent_key) if chunk.parent_key else b"",
                                      writer=chunk.writer and (chunk.writer if tenant.admin else
                                                               dataclasses.replace(chunk.writer, viewer=tenant.name)))
                  for chunk in chunks]
        new_owners = self._tenancy.new_namespaces(tenant, (chunk.namespace for chunk in scoped))
        if new_owners:
            self._cache.record_owners(new_owners)
            self._tenancy.record_owners(new_owners)
        return scoped

    async def Stats(self, request: cache_pb2.CacheStatsRequest, context) -> cache_pb2.CacheStatsReply:
        stats = self._cache.stats()
        tenant = self._caller()
        if tenant is not None and not tenant.admin:
            return self._tenant_stats(tenant, stats, request.namespace)
        counters = stats.counters
        namespaces = [
            cache_pb2.NamespaceStats(namespace=namespace, entries=usage.num_entries, bytes=usage.num_bytes,
                                     pinned=usage.num_pinned)
            for namespace, usage in sorted(stats.namespaces.items())
            if not request.namespace or namespace == request.namespace
        ]
        return cache_pb2.CacheStatsReply(
            entries=stats.num_entries, bytes=stats.num_bytes, max_bytes=stats.max_bytes, hits=counters.hits,
            misses=counters.misses, evictions=counters.evictions, corrupted=counters.corrupted,
            bytes_read=counters.bytes_read, bytes_written=counters.bytes_written, map_size=stats.map_size,
            namespaces=namespaces, l2=self._l2_stats(),
        )

    def _l2_stats(self) -> cache_pb2.L2Stats | None:
        if not isinstance(self._cache, TieredCache):
            return None
        # The fields the contract has (L2 time and bytes, arrivals included).
        fields = cache_pb2.L2Stats.DESCRIPTOR.fields_by_name
        return cache_pb2.L2Stats(**{name: value for name, value in dataclasses.asdict(self._cache.l2_stats()).items()
                                    if name in fields})

    def _tenant_stats(self, tenant: Tenant, stats: CacheStats, namespace: bytes) -> cache_pb2.CacheStatsReply:
        """Only the tenant's own namespaces and totals, max_bytes its share (the daemon's budget when
        it has none); daemon-wide counters (hits, evictions, ...) stay 0: they show others' traffic."""
        space = self._tenancy.space_of(tenant)
        namespaces = [
            cache_pb2.NamespaceStats(namespace=space.unscope(stored), entries=usage.num_entries, bytes=usage.num_bytes,
                                     pinned=usage.num_pinned)
            for stored, usage in stats.namespaces.items() if self._tenancy.owner_of(stored) == tenant.name
        ]
        return cache_pb2.CacheStatsReply(
            entries=sum(item.entries for item in namespaces), bytes=sum(item.bytes for item in namespaces),
            max_bytes=tenant.max_bytes or stats.max_bytes,
            namespaces=sorted((item for item in namespaces if not namespace or item.namespace == namespace),
                              key=lambda item: item.namespace),
        )

    async def Delete(self, request: cache_pb2.DeleteRequest, context) -> cache_pb2.DeleteReply:
        if request.keys and request.namespace:
            raise InvalidCacheRequest("DeleteRequest takes keys or a namespace, not both")
        if request.corrupted and request.namespace:
            raise InvalidCacheRequest("DeleteRequest.corrupted names keys, not a namespace")
        space = self._space()
        named_namespace, named_keys = None, []  # what a Store checked against it leaves out
        if request.namespace:
            check_digest(request.namespace, "DeleteRequest.namespace")
            named_namespace = space.scope(request.namespace)
            remove = functools.partial(self._cache.delete_namespace, named_namespace)
        elif request.keys:
            keys = [ChunkKey(key) for key in space.scope_all(checked_keys(request.keys, "DeleteRequest.keys"))]
            remove = functools.partial(self._cache.delete_keys, keys, request.corrupted)
            named_keys = [] if request.corrupted else keys  # a corrupted blob's good copy may be stored again
        else:
            raise InvalidCacheRequest("DeleteRequest needs keys or a namespace")
        result: DeleteResult = await self._executors.run(self._executors.store, self._counted, remove, self._viewer(),
                                                         named_namespace, named_keys)
        return cache_pb2.DeleteReply(deleted=result.deleted, bytes_freed=result.bytes_freed)

    async def Describe(self, request: cache_pb2.DescribeRequest, context) -> cache_pb2.DescribeReply:
        tenant = self._caller()
        if tenant is not None and not tenant.admin:
            # Opening the environment reads every tenant's blobs: co-located reads are for admins.
            self._refuse("Describe is for admin tokens when the daemon has tenants: a co-located reader sees "
                         "every tenant's chunks; this caller's blobs come over the Fetch stream")
        store = self._cache.store
        return cache_pb2.DescribeReply(data_dir=str(store.path.resolve()), environment_id=store.environment_id,
                                       map_size=store.map_size, max_bytes=self._cache.max_bytes,
                                       blob_db_version=BLOB_DB_VERSION)

    async def WatchEvents(self, request: cache_pb2.WatchEventsRequest,
                          context) -> AsyncIterator[cache_pb2.WatchEventsReply]:
        log_name, view = self._event_view()
        run_blocking = functools.partial(self._executors.run, self._executors.fetch)
        async for reply in watch_events(self._cache.events, log_name, view, request, self._cache.held_chunks,
                                        run_blocking):
            yield reply

    def _event_view(self) -> tuple[str | None, EventView]:
        """The log the caller follows (None: the daemon-wide one) and what it sees of it: a tenant its own
        log, an admin every tenant's events, each under its tenant's name and keys."""
        tenant = self._caller()
        if tenant is None:
            return None, EventView()
        tenancy = self._tenancy
        if tenant.admin:
            return None, EventView(tenancy.owner_of, tenancy.space_named)
        return tenant.name, EventView(tenancy.owner_of, tenancy.space_named, only_tenant=tenant.name)

    async def Pin(self, request: cache_pb2.PinRequest, context) -> cache_pb2.PinReply:
        return await self._set_pinned(request, pinned=True)

    async def Unpin(self, request: cache_pb2.PinRequest, context) -> cache_pb2.PinReply:
        return await self._set_pinned(request, pinned=False)

    async def _set_pinned(self, request: cache_pb2.PinRequest, pinned: bool) -> cache_pb2.PinReply:
        keys = checked_keys(request.keys, "PinRequest.keys")
        if not keys:
            raise InvalidCacheRequest("PinRequest needs at least one key")
        space = self._space()
        stored_keys = [ChunkKey(key) for key in space.scope_all(keys)]
        result: PinResult = await self._executors.run(self._executors.store, self._cache.set_pinned, stored_keys, pinned)
        return cache_pb2.PinReply(updated=result.updated, missing=[space.unscope(key) for key in result.missing])


def unscoped_entry(space: KeySpace, entry: Entry) -> Entry:
    if space is PLAIN:
        return entry
    return dataclasses.replace(entry, namespace=space.unscope(entry.namespace),
                               content_key=space.unscope_optional(entry.content_key))


def checked_keys(keys: Sequence[bytes], what: str) -> list[ChunkKey]:
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise InvalidCacheRequest(f"{what} holds {len(keys)} keys, more than {MAX_KEYS_PER_REQUEST}")
    for key in keys:
        check_digest(key, f"each of {what}")
    return [ChunkKey(key) for key in keys]


def checked_content_keys(content_keys: Sequence[bytes], num_prefix_keys: int) -> list[bytes]:
    """Empty, or one entry per prefix key, each empty (not content-addressed) or a digest."""
    if content_keys and len(content_keys) != num_prefix_keys:
        raise InvalidCacheRequest(f"content_keys must be empty or parallel to prefix_keys: got "
                             f"{len(content_keys)} for {num_prefix_keys}")
    for content_key in content_keys:
        if content_key:
            check_digest(content_key, "each of LookupRequest.content_keys")
    return list(content_keys)


def add_cache_servicer(servicer: CacheServicer, server: grpc.aio.Server) -> None:
    """Registers the service like the generated add_CacheServiceServicer_to_server, except that
    Fetch's replies are already wire-encoded ChunkFrames and pass through unserialized."""
    messages = cache_pb2
    handlers = {
        "Lookup": grpc.unary_unary_rpc_method_handler(
            servicer.Lookup, messages.LookupRequest.FromString, messages.LookupReply.SerializeToString),
        "Fetch": grpc.unary_stream_rpc_method_handler(servicer.Fetch, messages.FetchRequest.FromString, None),
        "Store": grpc.stream_unary_rpc_method_handler(
            servicer.Store, messages.ChunkFrame.FromString, messages.StoreReply.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            servicer.Stats, messages.CacheStatsRequest.FromString, messages.CacheStatsReply.SerializeToString),
        "Delete": grpc.unary_unary_rpc_method_handler(
            servicer.Delete, messages.DeleteRequest.FromString, messages.DeleteReply.SerializeToString),
        "Pin": grpc.unary_unary_rpc_method_handler(
            servicer.Pin, messages.PinRequest.FromString, messages.PinReply.SerializeToString),
        "Unpin": grpc.unary_unary_rpc_method_handler(
            servicer.Unpin, messages.PinRequest.FromString, messages.PinReply.SerializeToString),
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe, messages.DescribeRequest.FromString, messages.DescribeReply.SerializeToString),
        "WatchEvents": grpc.unary_stream_rpc_method_handler(
            servicer.WatchEvents, messages.WatchEventsRequest.FromString,
            messages.WatchEventsReply.SerializeToString),
    }
    service_name = messages.DESCRIPTOR.services_by_name["CacheService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)
