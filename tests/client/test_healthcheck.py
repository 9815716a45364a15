"""client.healthcheck: one Check for compose health checks, a Watch-based wait for client.stack."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client import healthcheck
from tests.client_fakes import running_server
from tests.conftest import pick_free_port

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def test_check_and_main_on_a_serving_server(capsys) -> None:
    with running_server() as address:
        assert healthcheck.check_health(address) == "SERVING"
        assert healthcheck.check_health(address, service="kvboost.v1.Nothing") == "SERVICE_UNKNOWN"
        assert healthcheck.main([address]) == 0
    assert capsys.readouterr().out == f"{address}: SERVING\n"


def test_main_exits_1_when_unreachable(capsys) -> None:
    address = f"127.0.0.1:{pick_free_port()}"
    assert healthcheck.main([address, "--timeout", "0.5"]) == 1
    assert capsys.readouterr().out == f"{address}: UNREACHABLE\n"


def test_wait_follows_a_server_that_starts_late_and_turns_serving() -> None:
    port = pick_free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")

    def start_then_serve() -> None:
        server.start()
        servicer.set("", SERVING)

    starter = threading.Timer(0.5, start_then_serve)
    starter.start()
    try:
        begun = time.monotonic()
        assert healthcheck.wait_until_serving(f"127.0.0.1:{port}", deadline_s=20) == "SERVING"
        assert time.monotonic() - begun < 5
    finally:
        starter.join()
        server.stop(grace=None)


def test_wait_gives_up_when_the_process_is_gone() -> None:
    begun = time.monotonic()
    status = healthcheck.wait_until_serving(f"127.0.0.1:{pick_free_port()}", deadline_s=30, is_alive=lambda: False)
    assert status == "UNREACHABLE" and time.monotonic() - begun < 1
