"""Where a KV-event socket binds, from a flag's value (pure: no zmq import)."""
from __future__ import annotations


def zmq_endpoint(text: str, default_host: str = "127.0.0.1") -> str:
    """A ZMQ endpoint from a flag: tcp://..., ipc://... and inproc://... as given, HOST:PORT over tcp, and a bare
    PORT on default_host (loopback: nothing beyond this host reads the stream unless told to)."""
    if "://" in text:
        return text
    if text.isdigit():
        return f"tcp://{default_host}:{text}"
    host, separator, port = text.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"a KV-event endpoint is PORT, HOST:PORT or a ZMQ URL (tcp://HOST:PORT), got {text!r}")
    return f"tcp://{host}:{port}"
