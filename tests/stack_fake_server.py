"""A stand-in server process for the stack tests: a gRPC health service on --listen, nothing else."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--ignore-sigterm", action="store_true", help="only SIGKILL stops it")
    parser.add_argument("--fail", action="store_true", help="print a reason and exit 3 at once")
    args, _ = parser.parse_known_args()
    if args.fail:
        print("fake server: cannot open the data folder", flush=True)
        return 3
    stop = threading.Event()
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else (lambda *_: stop.set()))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(args.listen)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"fake server serving on {args.listen}", flush=True)
    stop.wait()
    server.stop(grace=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
