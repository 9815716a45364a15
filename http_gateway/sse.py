"""Server-sent events: `data: <json>` frames, and a response that stops its producer when the client leaves."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from http_gateway.disconnect import wait_for_disconnect

DONE = b"data: [DONE]\n\n"


def encode(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class EventStreamResponse(Response):
    """Streams `frames`; a disconnect (seen on receive or as a failed send) closes the frames' generator,
    whose `finally` cancels the gRPC call, and calls on_disconnect()."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], headers: dict[str, str],
                 on_disconnect: Callable[[], None] = lambda: None) -> None:
        # As StreamingResponse does: no body, so no Content-Length header.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self.frames = frames
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                if not task.done():
                    task.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            await self.frames.aclose()  # runs the producer's cleanup if the stream was cut short
        if stream.cancelled() or not stream.result():  # a failure of the producer itself raises here
            self.on_disconnect()

    async def _stream(self, send: Send) -> bool:
        """True when every frame went out; False when a send failed (the client is gone)."""
        try:
            async for frame in self.frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            return False
        return True
