"""Waiting on work while watching the HTTP client: a client that leaves cancels the work (and its gRPC call)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict]]


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the ASGI server reports http.disconnect (the request body must already be read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """The result of `work`; raises ClientDisconnected (after cancelling `work`) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
