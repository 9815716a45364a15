"""`python -m router`: serve the InferenceService API in front of replicas, routing by their daemons' KV events."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Sequence

from router.config import RouterConfig, parse_config
from router.event_follower import EventFollower
from router.monitor import ReplicaMonitor
from router.replicas import Replica, bearer_metadata, build_replicas, open_channel
from router.request_keys import RequestKeys
from router.routing import Router
from router.scoring import CostWeights
from router.server import build_server
from router.startup import StartupError, agreed_model, check_tokenizer
from router.tokenizer import TokenizerNotFound, load_tokenizer, tokenizer_source

logger = logging.getLogger("router")

SHUTDOWN_GRACE_S = 5.0


async def prepare(config: RouterConfig,
                  replicas: Sequence[Replica]) -> tuple[Router, RequestKeys | None, ReplicaMonitor]:
    """Start-up checks, then the parts that serve. Raises StartupError, TokenizerNotFound, OSError or ValueError."""
    identity = await agreed_model(replicas, config.startup_timeout_s)
    logger.info("every replica serves %s", identity.describe())
    router = Router(replicas, config.policy, CostWeights(config.content_weight, config.load_cost_tokens),
                    config.cache_tenant)
    keys = None
    if router.keys_requests:
        source = tokenizer_source(identity.model, config.tokenizer)
        tokenizer = await asyncio.to_thread(load_tokenizer, source)
        # One replica is enough: the agreed namespace digests every replica's tokenizer too.
        await check_tokenizer(tokenizer, source, replicas[0])
        logger.info("tokenizer from %s tokenizes as %s does", source, replicas[0].name)
        keys = RequestKeys(tokenizer, identity)
    return router, keys, ReplicaMonitor(replicas, identity, config.stats_interval_s)


def followers(config: RouterConfig, replicas: Sequence[Replica]) -> list[EventFollower]:
    """One WatchEvents follower per daemon, feeding that replica's holdings."""
    metadata = bearer_metadata(config.cache_auth_token())
    return [EventFollower(replica.name, open_channel(replica.address.daemon, config.cache_tls, config.cache_tls_ca,
                                                     config.max_message_bytes), replica.events, metadata)
            for replica in replicas]


async def serve(config: RouterConfig) -> int:
    """Serves until SIGTERM or SIGINT; returns the exit status (2: the replicas cannot be served together)."""
    replicas = build_replicas(config)
    try:
        router, keys, monitor = await prepare(config, replicas)
    except (StartupError, TokenizerNotFound, OSError, ValueError) as error:
        logger.error("cannot start: %s", error)
        return 2
    server = build_server(config, router, keys)
    watchers = followers(config, replicas) if router.keys_requests else []
    tasks = [asyncio.create_task(monitor.run())] + [asyncio.create_task(watcher.run()) for watcher in watchers]
    await server.start()
    logger.info("listening on %s (port %d), policy %s, %d replicas", config.listen, server.port, config.policy,
                len(replicas))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("shutting down")
    await server.stop(SHUTDOWN_GRACE_S)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in [replica.channel for replica in replicas] + [watcher.channel for watcher in watchers]:
        await channel.close()
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("configuration:\n%s", config.describe())
    sys.exit(asyncio.run(serve(config)))


if __name__ == "__main__":
    main()
