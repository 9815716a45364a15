"""Reads every replica's health and Stats periodically: load for the policies, and which replicas to skip."""
from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2

from kvboost.v1 import inference_pb2 as pb
from router.model_identity import ModelIdentity
from router.replicas import Replica

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING


class ReplicaMonitor:
    """A replica is healthy while its health says SERVING and its Stats answer; one coming back is asked its
    ModelInfo again, and skipped while it serves other keys (restarted with another model)."""

    def __init__(self, replicas: Sequence[Replica], identity: ModelIdentity, interval_s: float) -> None:
        self.replicas = list(replicas)
        self.identity = identity
        self.interval_s = interval_s
        self.timeout_s = max(1.0, 2 * interval_s)
        self._refused: dict[int, ModelIdentity] = {}  # replicas serving other keys, logged once per identity

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(replica) for replica in self.replicas))

    async def probe(self, replica: Replica) -> None:
        in_flight = replica.in_flight
        try:
            serving = await self._serving(replica)
            if serving:
                replica.record_stats(await replica.stub.Stats(
                    pb.ServiceStatsRequest(), metadata=replica.own_metadata, timeout=self.timeout_s), in_flight)
        except grpc.aio.AioRpcError as error:
            serving = False
            if replica.healthy:
                logger.warning("%s stopped answering (%s: %s): skipped until it serves again", replica.name,
                               error.code().name, error.details())
        if serving and not replica.healthy:
            logger.info("%s serves again", replica.name)
        replica.healthy = serving

    async def _serving(self, replica: Replica) -> bool:
        reply = await replica.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                           metadata=replica.own_metadata, timeout=self.timeout_s)
        if reply.status != _SERVING:
            return False
        if replica.healthy:
            return True
        reply = await replica.stub.ModelInfo(pb.ModelInfoRequest(), metadata=replica.own_metadata,
                                             timeout=self.timeout_s)
        found = ModelIdentity.from_reply(reply)
        replica.record_model_info(reply)
        if found.differs_from(self.identity):
            if self._refused.get(replica.index) != found:
                logger.error("%s came back serving other keys (%s; the others: %s): not routed to",
                             replica.name, found.describe(), self.identity.describe())
                self._refused[replica.index] = found
            return False
        return True
