"""Follows one daemon's WatchEvents into its replica's EventFeed: reconnects with backoff, resumes from the
cursor, resyncs when the daemon says `lost`."""
from __future__ import annotations

import asyncio
import logging

import grpc

from kvboost.v1 import cache_pb2, cache_pb2_grpc
from router.event_feed import EventFeed, EventGap

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


class EventFollower:
    """One stream at a time per daemon; `run` returns only when cancelled."""

    def __init__(self, name: str, channel: grpc.aio.Channel, feed: EventFeed,
                 metadata: tuple[tuple[str, str], ...] = (), snapshot_page_size: int = 0) -> None:
        self.name = name
        self.channel = channel
        self.stub = cache_pb2_grpc.CacheServiceStub(channel)
        self.feed = feed
        self.metadata = metadata
        self.snapshot_page_size = snapshot_page_size

    async def run(self) -> None:
        backoff = FIRST_BACKOFF_S
        while True:
            if await self._follow_once():
                backoff = FIRST_BACKOFF_S  # it was live: the next break is a new outage
            self.feed.interrupted()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _follow_once(self) -> bool:
        """One stream until it ends or breaks; True when it delivered anything."""
        cursor = self.feed.cursor
        request = cache_pb2.WatchEventsRequest(incarnation=cursor.incarnation, from_sequence=cursor.next_sequence,
                                               snapshot_page_size=self.snapshot_page_size)
        call = self.stub.WatchEvents(request, metadata=self.metadata)
        delivered = False
        try:
            async for reply in call:
                if reply.WhichOneof("body") == "lost":
                    logger.info("%s: its daemon says events were lost (%s): resyncing from a snapshot", self.name,
                                reply.lost.reason)
                elif not delivered:
                    logger.info("%s: following its daemon's events from where they stopped", self.name)
                self.feed.receive(reply)
                delivered = True
        except grpc.aio.AioRpcError as error:
            level = logging.ERROR if error.code() in _CONFIGURATION_ERRORS else logging.WARNING
            logger.log(level, "%s: daemon events stream: %s: %s", self.name, error.code().name, error.details())
        except EventGap as gap:
            logger.warning("%s: daemon events out of order (%s): reconnecting from the cursor", self.name, gap)
        finally:
            call.cancel()
        return delivered


# Failures no retry mends without an operator: logged as errors (retries continue, slowly).
_CONFIGURATION_ERRORS = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
                                   grpc.StatusCode.PERMISSION_DENIED})
