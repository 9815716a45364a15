"""The composition root: the HTTP gateway and the inference service in one process (`python -m kvboost_server`).

Neither package imports the other; this one wires the gateway's app to the service's servicer through an
in-process transport (kvboost_server.in_process) instead of a gRPC channel, and still serves the gRPC contract
on the service's own --listen address for gRPC clients, the router and the CLI.
"""
