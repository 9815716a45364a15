"""client.healthcheck: one Check for compose health checks, a Watch-based wait for client.stack."""
from __future__ import annotations

import threading
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
    polls: list[int] = []
    turn_serving = threading.Timer(0.3, servicer.set, ("", SERVING))

    def is_alive() -> bool:
        # The server starts only once the wait has begun, and the waiter gets three polls (one Watch each,
        # at most a second apiece): following the Watch stream needs one or two; sleeping out the deadline, 20.
        polls.append(1)
        if len(polls) == 1:
            server.start()
            turn_serving.start()
        return len(polls) <= 3

    try:
        assert healthcheck.wait_until_serving(f"127.0.0.1:{port}", deadline_s=20, is_alive=is_alive) == "SERVING"
    finally:
        turn_serving.join()
        server.stop(grace=None)


def test_wait_gives_up_when_the_process_is_gone() -> None:
    polls: list[int] = []

    def is_alive() -> bool:
        polls.append(1)
        return False

    status = healthcheck.wait_until_serving(f"127.0.0.1:{pick_free_port()}", deadline_s=30, is_alive=is_alive)
    assert status == "UNREACHABLE" and len(polls) == 1  # asked once, before any call: no wait for the deadline
