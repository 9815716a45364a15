"""Administrative client of the cache daemon: Stats, Delete, Pin and Unpin."""
from __future__ import annotations

from collections.abc import Iterable

import grpc

from kvboost.v1 import cache_pb2, cache_pb2_grpc

from client.channel import RpcChannel
from client.errors import InvalidArgumentError
from client.request_builders import parse_key
from client.results import CacheStats, DeleteResult, PinResult

DEFAULT_DAEMON_ADDRESS = "127.0.0.1:50052"


class CacheClient:
    """Client of kvboost.v1.CacheService for operators. Keys and namespaces are 32-byte digests,
    given as bytes or hex; results report them as hex. Arguments as for KVBoostClient."""

    def __init__(
        self,
        address: str = DEFAULT_DAEMON_ADDRESS,
        token: str | None = None,
        timeout: float | None = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._rpc = RpcChannel(address, token, timeout, credentials)
        self._stub = cache_pb2_grpc.CacheServiceStub(self._rpc.channel)

    @property
    def address(self) -> str:
        return self._rpc.address

    def stats(self, namespace: str | bytes | None = None, *, timeout: float | None = None) -> CacheStats:
        """Entries, bytes and counters, of one namespace when given."""
        request = cache_pb2.CacheStatsRequest(namespace=parse_key(namespace) if namespace else b"")
        return CacheStats.from_proto(self._rpc.call("Stats", self._stub.Stats, request, timeout))

    def delete(
        self,
        keys: Iterable[str | bytes] = (),
        *,
        namespace: str | bytes | None = None,
        timeout: float | None = None,
    ) -> DeleteResult:
        """Deletes the given keys, or every entry of `namespace` (NotFoundError when it has none)."""
        key_bytes = [parse_key(key) for key in keys]
        if bool(key_bytes) == bool(namespace):
            raise InvalidArgumentError("give keys or a namespace to delete, not both and not neither")
        request = cache_pb2.DeleteRequest(keys=key_bytes, namespace=parse_key(namespace) if namespace else b"")
        return DeleteResult.from_proto(self._rpc.call("Delete", self._stub.Delete, request, timeout))

    def pin(self, keys: Iterable[str | bytes], *, timeout: float | None = None) -> PinResult:
        """Pins the keys (never evicted); NotFoundError when none of them exist."""
        request = cache_pb2.PinRequest(keys=[parse_key(key) for key in keys])
        return PinResult.from_proto(self._rpc.call("Pin", self._stub.Pin, request, timeout))

    def unpin(self, keys: Iterable[str | bytes], *, timeout: float | None = None) -> PinResult:
        request = cache_pb2.PinRequest(keys=[parse_key(key) for key in keys])
        return PinResult.from_proto(self._rpc.call("Unpin", self._stub.Unpin, request, timeout))

    def close(self) -> None:
        self._rpc.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
