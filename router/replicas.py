"""The replicas as the router sees them: a channel each, health, load, and what their daemon holds."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from router.config import ReplicaAddress, RouterConfig
from router.event_feed import EventFeed


def open_channel(address: str, tls: bool, roots_file: str, max_message_bytes: int) -> grpc.aio.Channel:
    """A grpc.aio channel; TLS with the roots in roots_file (empty: the system roots) when tls or roots_file."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes)]
    if not tls and not roots_file:
        return grpc.aio.insecure_channel(address, options=options)
    roots = Path(roots_file).read_bytes() if roots_file else None
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(roots), options=options)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Replica:
    """One replica: stubs for its service, its health and load as last read, this router's traffic to it,
    and its daemon's holdings (kept by its EventFeed)."""

    def __init__(self, index: int, address: ReplicaAddress, channel: grpc.aio.Channel,
                 own_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.index = index
        self.address = address
        self.name = f"replica {index} ({address.service})"
        self.channel = channel
        self.stub = inference_pb2_grpc.InferenceServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.own_metadata = own_metadata  # for the router's own calls; forwarded calls carry the caller's
        self.events = EventFeed()
        self.healthy = False  # until start-up or a probe finds it serving the model every replica agreed on
        self.degraded = False  # the service cannot reach its daemon: its cache gives nothing now
        self.default_mode = pb.PREFIX_CACHE  # the mode its requests that name none run in (ModelInfo)
        self.in_flight = 0
        self.num_routed = 0
        self.num_failed = 0  # calls that failed with a retryable status (unreachable, queue full)
        self._polled_load = 0  # running rows + waiting requests at the last Stats read
        self._in_flight_at_poll = 0

    @property
    def holdings(self):
        return self.events.holdings

    @property
    def load(self) -> int:
        """Requests running or queued there now: this router's in flight, plus what the last Stats read showed
        beyond this router's own in-flight requests at that moment (other clients' work)."""
        return self.in_flight + max(0, self._polled_load - self._in_flight_at_poll)

    def record_model_info(self, reply: pb.ModelInfoReply) -> None:
        """Keeps the replica's default mode; a service older than the field (MODE_UNSPECIFIED) defaulted to
        CHUNK_KV_REUSE."""
        self.default_mode = reply.default_mode or pb.CHUNK_KV_REUSE

    def record_stats(self, stats: pb.ServiceStatsReply, in_flight_when_asked: int) -> None:
        self._polled_load = stats.running_rows + stats.waiting_requests
        self._in_flight_at_poll = in_flight_when_asked
        self.degraded = stats.degraded

    @contextmanager
    def routed(self) -> Iterator[None]:
        """Counts one request in flight here while the block runs."""
        self.in_flight += 1
        self.num_routed += 1
        try:
            yield
        finally:
            self.in_flight -= 1


def build_replicas(config: RouterConfig) -> list[Replica]:
    own = bearer_metadata(config.replica_auth_token())
    return [Replica(index, address, open_channel(address.service, config.replica_tls, config.replica_tls_ca,
                                                 config.max_message_bytes), own)
            for index, address in enumerate(config.replicas)]
