"""`python -m client.healthcheck ADDR`: exit 0 when the server's gRPC health service says SERVING."""
from __future__ import annotations

import argparse
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
# Reconnect quickly while a server starts (gRPC's default backoff grows to two minutes).
_FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]


def check_health(address: str, service: str = "", timeout: float = 2.0) -> str:
    """The health status name of `service` on `address` (SERVING, NOT_SERVING, ...) or UNREACHABLE."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_until_serving(address: str, deadline_s: float, service: str = "", is_alive=lambda: True) -> str:
    """Waits on the health service's Watch stream until SERVING, `deadline_s` passes or `is_alive()`
    turns false (checked at least once a second, so a crashed process is noticed early).

    Returns:
        The last status seen ("SERVING" on success, "UNREACHABLE" when never connected).
    """
    give_up_at = time.monotonic() + deadline_s
    status = "UNREACHABLE"
    request = health_pb2.HealthCheckRequest(service=service)
    with grpc.insecure_channel(address, options=_FAST_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while is_alive() and (remaining := give_up_at - time.monotonic()) > 0:
            try:
                # wait_for_ready: the call waits for the server to listen instead of failing at once.
                for reply in stub.Watch(request, timeout=min(1.0, remaining), wait_for_ready=True):
                    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    if reply.status == SERVING:
                        return status
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    # The server is going away or answers oddly: back off briefly before asking again.
                    status = "UNREACHABLE"
                    time.sleep(0.2)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client.healthcheck", description=__doc__)
    parser.add_argument("address", help="host:port of the server")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status = check_health(args.address, args.service, args.timeout)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
