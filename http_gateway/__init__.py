"""An OpenAI-compatible HTTP gateway in front of the KVBoost inference service (a gRPC client of it)."""
