"""A gRPC channel to one server that applies the bearer token, the timeout and error mapping to every call."""
from __future__ import annotations

from typing import Any, Callable

import grpc

from client.errors import UnavailableError, from_rpc_error

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class RpcChannel:
    """Owns one grpc.Channel; `call` runs a unary RPC and turns grpc.RpcError into KVBoostError."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        options = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ]
        if credentials is not None:
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()

    def deadline(self, timeout: float | None) -> float | None:
        """The per-call timeout when given, else the channel's default."""
        return self.timeout if timeout is None else timeout

    def call(self, name: str, method: Callable[..., Any], request: Any, timeout: float | None = None) -> Any:
        deadline = self.deadline(timeout)
        try:
            return method(request, timeout=deadline, metadata=self.metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error, name, self.address, deadline) from None

    def wait_ready(self, timeout: float) -> None:
        """Blocks until the channel connects.

        Raises:
            UnavailableError: when it does not connect within `timeout` seconds.
        """
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(f"cannot reach {self.address} within {timeout} s",
                                   code=grpc.StatusCode.UNAVAILABLE) from None

    def close(self) -> None:
        self.channel.close()
