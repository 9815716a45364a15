"""Starts the KV-event publisher a service was asked for and hangs it on L0 (only when the flag is on: pyzmq loads
here)."""
from __future__ import annotations

import logging

from inference_service.serving.config import ServiceConfig
from kvboost_common.kv_events.endpoints import zmq_endpoint

logger = logging.getLogger(__name__)


def start_kv_events(config: ServiceConfig, engine):
    """The publisher, listening to the engine's L0; None when --kv-events-endpoint is empty or nothing can be
    published (no L0; --tenant-salt scopes every chunk, unless --kv-events-publish-salted)."""
    if not config.kv_events_endpoint:
        return None
    l0 = engine.parts.l0
    if l0 is None:
        logger.warning("KV events: not published, there is no L0 (--l0-bytes 0, or --kv-cache-bits below 16)")
        return None
    if config.engine.tenant_salt and not config.kv_events_publish_salted:
        logger.warning("KV events: not published, --tenant-salt scopes every chunk (--kv-events-publish-salted "
                       "publishes them)")
        return None
    from kvboost_common.kv_events.publisher import KvEventPublisher, KvEventsConfig

    publisher = KvEventPublisher(KvEventsConfig(
        endpoint=zmq_endpoint(config.kv_events_endpoint),
        topic=config.kv_events_topic,
        replay_endpoint=zmq_endpoint(config.kv_events_replay_endpoint) if config.kv_events_replay_endpoint else "",
        block_size=config.kv_events_block_size,
        medium=device_medium(engine.device.type),
        publish_salted=config.kv_events_publish_salted,
    ), seed=engine.namespace)
    l0.listener = publisher
    return publisher


def device_medium(device_type: str) -> str:
    """What L0 is, in the routers' words: device memory on CUDA, host memory on a CPU."""
    return "GPU" if device_type == "cuda" else "CPU"
