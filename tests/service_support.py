"""An in-process inference server on its own event-loop thread, for synchronous gRPC tests."""
from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Iterator

from inference_service.serving.config import ServiceConfig
from inference_service.serving.server import build_server


@contextmanager
def serving_in_thread(config: ServiceConfig, engine) -> Iterator[int]:
    """Starts build_server(config, engine) on a background event loop; yields its port; stops it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = build_server(config, engine)
        await server.start()
        return server

    try:
        server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
        try:
            yield server.port
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
