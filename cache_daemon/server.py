"""Assembles the daemon: gRPC server with health and reflection, metrics, frequency flusher."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvboost.v1 import cache_pb2

from cache_daemon.allocator import trim_heap
from cache_daemon.cache import NAMESPACE_OWNER_PREFIX, ChunkCache
from cache_daemon.config import DaemonConfig
from cache_daemon.errors import CacheError, StartupError
from cache_daemon.interceptors import RequestContextInterceptor
from cache_daemon.metrics import CallsInFlight, Refusals, start_metrics_server
from cache_daemon.executors import DaemonExecutors
from cache_daemon.servicer import CacheServicer, StoreLimits, add_cache_servicer
from cache_daemon.l2.address import parse_l2_address
from cache_daemon.l2.record_auth import load_keyring
from cache_daemon.l2.redis_tier import RedisTier
from cache_daemon.tenancy_secret import tenancy_secret
from cache_daemon.tiered import TieredCache
from cache_daemon.tenancy import Tenancy, Tenant, current_tenant, load_tenants_file
from kvboost_common.auth import BearerTokenInterceptor, TokenTableInterceptor, load_token
from kvboost_common.addresses import is_unix
from kvboost_common.binding import bind
from kvboost_common.handlers import replace_behavior
from kvboost_common.undecodable import UndecodableRequestInterceptor

logger = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name
# The calls a stop waits for (counted by method name): the cache's own, not a health watch or a reflection stream.
CACHE_METHODS = frozenset(method.name for method in cache_pb2.DESCRIPTOR.services_by_name["CacheService"].methods)
SHUTTING_DOWN = "daemon is shutting down, retry on another replica"
_HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
_DRAIN_POLL_S = 0.02


class ShutdownGate(grpc.aio.ServerInterceptor):
    """The outermost interceptor: once closed, every new call but a health check is refused with UNAVAILABLE before
    any handler runs. The daemon closes it on SIGTERM and stops the server only after the calls in flight are done,
    so a new call meets this refusal, which clients retry elsewhere; gRPC's own stop answers a call that races it
    with CANCELLED."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not self.closed or details.method.startswith(_HEALTH_METHOD_PREFIX):
            return handler
        return replace_behavior(handler, lambda behavior: _refuse_shutting_down)


async def _refuse_shutting_down(request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)


def grpc_options(config: DaemonConfig) -> list[tuple[str, int]]:
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second daemon on the same port must fail, not share it
    ]
    if config.max_concurrent_streams:
        options.append(("grpc.max_concurrent_streams", config.max_concurrent_streams))
    return options


def open_tenancy(cache: ChunkCache | TieredCache, tenants_by_token: dict[str, Tenant],
                 secret_file: Path | None = None) -> Tenancy:
    """The tenants' key spaces (from --tenancy-secret-file, else this LMDB's own secret; never from
    Redis) and the recorded namespace owners."""
    store = cache.store
    secret = tenancy_secret(store, secret_file)
    owners = {namespace: name.decode() for namespace, name in store.info_items(NAMESPACE_OWNER_PREFIX).items()}
    return Tenancy(secret, tenants_by_token.values(), owners)


def open_cache(config: DaemonConfig, tenants_by_token: dict[str, Tenant] | None = None) -> ChunkCache | TieredCache:
    """LMDB, with the L2 tier in front of Redis when --l2 is set (L2 may be down: it is retried)."""
    keyring = None
    if config.l2:
        try:
            keyring = load_keyring(config.l2_key_file)
        except ValueError as error:
            raise StartupError(str(error)) from error
    cache = ChunkCache.open(config.data_dir, config.initial_map_size, config.max_bytes, config.half_life,
                            share_budgets(tenants_by_token), config.event_history)
    address = config.l2_address()
    if address is None:
        return cache
    tier = RedisTier(address, keyring, wait_replicas=config.num_l2_wait_replicas, timeout_s=config.l2_timeout_s,
                     retry_interval_s=config.l2_retry_interval_s, tls_files=config.l2_tls_files())
    logger.info("L2 tier: %s, writes %s, records signed with key %r (%d keys verify)", address.redacted(),
                config.l2_write, keyring.signing_id, len(keyring.keys))
    return TieredCache(cache, tier, sync_writes=config.l2_write == "sync", queue_bytes=config.l2_queue_bytes,
                       sync_deadline_s=config.l2_sync_timeout_s, promote_batch=config.l2_promote_batch)


def share_budgets(tenants_by_token: dict[str, Tenant] | None) -> dict[str, int]:
    """Tenant -> max_bytes for the tenants with a share of the budget of their own."""
    return {tenant.name: tenant.max_bytes for tenant in (tenants_by_token or {}).values()
            if tenant.max_bytes is not None and not tenant.admin}


def build_server(config: DaemonConfig, cache: ChunkCache, health_servicer: health.aio.HealthServicer,
                 refusals: Refusals | None = None, tenants_by_token: dict[str, Tenant] | None = None,
                 executors: DaemonExecutors | None = None, in_flight: CallsInFlight | None = None,
                 gate: ShutdownGate | None = None) -> tuple[grpc.aio.Server, int, Tenancy | None]:
    """The server with every service registered, bound to config.listen (port 0 picks a free
    port); returns it with the bound port and the tenancy (None without --tenants-file). Not started.
    tenants_by_token: the tenants file's contents, read here when not given. gate: refuses new calls once closed."""
    refusals = refusals or Refusals()
    interceptors: list[grpc.aio.ServerInterceptor] = [gate or ShutdownGate(), RequestContextInterceptor(in_flight)]
    tenancy = None
    count_unauthenticated = lambda: refusals.count("unauthenticated")  # noqa: E731
    if config.auth_token_file is not None:
        interceptors.append(BearerTokenInterceptor(load_token(config.auth_token_file), count_unauthenticated))
    elif config.tenants_file is not None:
        tenants_by_token = tenants_by_token or load_tenants_file(config.tenants_file)
        tenancy = open_tenancy(cache, tenants_by_token, config.tenancy_secret_file)
        cache.events.set_owner_lookup(tenancy.owner_of)  # each tenant's events also go into a log of its own
        interceptors.append(TokenTableInterceptor(tenants_by_token, current_tenant, count_unauthenticated))
    interceptors.append(UndecodableRequestInterceptor())  # innermost: unauthenticated calls are refused first
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options(config))
    store_limits = StoreLimits(config.max_store_chunks, config.store_bytes_limit, config.store_deadline_s)
    add_cache_servicer(CacheServicer(cache, tenancy, refusals, store_limits, executors), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    return server, bind(server, config.listen, config.tls_cert, config.tls_key), tenancy


class CacheDaemon:
    """A running daemon; `start` opens everything, `stop` shuts it down gracefully."""

    def __init__(self, config: DaemonConfig, cache: ChunkCache, server: grpc.aio.Server, port: int,
                 health_servicer: health.aio.HealthServicer, executors: DaemonExecutors,
                 in_flight: CallsInFlight, gate: ShutdownGate) -> None:
        self.config = config
        self.in_flight = in_flight  # what the interceptor counts
        self.gate = gate
        self.executors = executors
        self.cache = cache
        self.server = server
        self.port = port
        self._health = health_servicer
        self._stop_metrics: Callable[[], None] | None = None
        self._flusher: asyncio.Task | None = None
        self._heap_trimmer: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.config.listen if is_unix(self.config.listen) else f"{self.config.host}:{self.port}"

    @classmethod
    async def start(cls, config: DaemonConfig) -> CacheDaemon:
        tenants_by_token = None
        if config.tenants_file is not None:
            try:
                tenants_by_token = load_tenants_file(config.tenants_file)
            except (OSError, ValueError) as error:
                raise StartupError(f"cannot use --tenants-file {config.tenants_file}: {error}") from error
        try:
            cache = await asyncio.to_thread(open_cache, config, tenants_by_token)
        except (RuntimeError, OSError, ValueError) as error:
            raise StartupError(f"cannot open {config.data_dir}: {error}") from error
        health_servicer = health.aio.HealthServicer()
        refusals = Refusals()
        in_flight = CallsInFlight()
        executors = DaemonExecutors()
        gate = ShutdownGate()
        try:
            server, port, tenancy = build_server(config, cache, health_servicer, refusals, tenants_by_token, executors,
                                                 in_flight, gate)
        except (RuntimeError, OSError, ValueError, StartupError) as error:
            cache.close()
            executors.shutdown()
            if isinstance(error, StartupError):
                raise
            raise StartupError(f"cannot serve on {config.listen}: {error}") from error
        daemon = cls(config, cache, server, port, health_servicer, executors, in_flight, gate)
        await server.start()
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        if config.metrics_port:
            daemon._stop_metrics = start_metrics_server(cache, config.host, config.metrics_port, refusals,
                                                        None if tenancy is None else tenancy.owner_of, in_flight)
        if tenancy is not None:
            logger.info("tenancy on: %s", ", ".join(f"{tenant.name}{' (admin)' if tenant.admin else ''}"
                                                    for tenant in tenancy.tenants.values()))
        daemon._flusher = asyncio.create_task(_flush_periodically(cache, config.flush_interval_s))
        if config.heap_trim_interval_s:
            daemon._heap_trimmer = asyncio.create_task(_trim_heap_periodically(config.heap_trim_interval_s))
        stats = cache.stats()
        logger.info("serving %s on %s: %d chunks, %d of %d bytes, LMDB map %d bytes in %s", SERVICE_NAME,
                    daemon.address, stats.num_entries, stats.num_bytes, stats.max_bytes, stats.map_size,
                    config.data_dir)
        return daemon

    async def stop(self) -> None:
        """Refuse new calls with UNAVAILABLE (health checks answer NOT_SERVING), end the event watches (they never
        finish by themselves), let in-flight calls finish within --shutdown-grace, stop the server, flush
        frequencies, sync and close LMDB."""
        self.gate.close()
        await self._health.enter_graceful_shutdown()
        self.cache.events.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shutdown_grace_s
        await self._drain(deadline)
        await self.server.stop(max(deadline - loop.time(), 0.0))
        for task in (self._flusher, self._heap_trimmer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._stop_metrics is not None:
            self._stop_metrics()
        await asyncio.to_thread(self.executors.shutdown)
        await asyncio.to_thread(self.cache.close)
        logger.info("stopped; frequencies flushed and LMDB synced")

    async def _drain(self, deadline: float) -> None:
        """Returns when no cache call is in flight or at deadline (loop time); the server keeps listening, so a
        new call is refused by the gate rather than by the transport."""
        loop = asyncio.get_running_loop()
        # Polled: the count is the interceptor's thread-safe counter, with nothing to await; a signal on every
        # call's exit would cost each call, the poll costs only the stop.
        while CACHE_METHODS & self.in_flight.snapshot().keys() and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_DRAIN_POLL_S)


async def _flush_periodically(cache: ChunkCache, interval_s: float) -> None:
    failing = False  # a full disk fails every flush until it has room: said once, and again when it is over
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(cache.flush_hits)
            await asyncio.to_thread(cache.store.clear_stale_readers)
        except CacheError as error:
            if not failing:
                logger.warning("flushing hit counts failed; they are kept and retried every %g s: %s", interval_s, error)
            failing = True
        except Exception:
            logger.exception("flushing hit counts failed; they are retried at the next flush")
        else:
            if failing:
                logger.info("flushing hit counts works again")
            failing = False


async def _trim_heap_periodically(interval_s: float) -> None:
    """In a thread: malloc_trim walks every arena and locks each in turn (about 15 ms when it gives back
    140 MiB, 0.1 ms when nothing is free)."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(trim_heap)


def log_config(config: DaemonConfig) -> None:
    shown = dataclasses.replace(config, l2=parse_l2_address(config.l2).redacted()) if config.l2 else config
    logger.info("config: %s", shown)
    if not config.is_loopback and config.auth_token_file is None and config.tenants_file is None:
        logger.warning("listening on %s beyond loopback without --auth-token-file: anyone who can reach "
                       "the port can read and write the cache", config.listen)


async def serve(config: DaemonConfig) -> None:
    """Runs the daemon until SIGTERM or SIGINT."""
    log_config(config)
    daemon = await CacheDaemon.start(config)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop_requested.set)
    await stop_requested.wait()
    logger.info("shutdown requested: %s, given up to --shutdown-grace %g s", daemon.in_flight.describe(),
                config.shutdown_grace_s)
    await daemon.stop()
