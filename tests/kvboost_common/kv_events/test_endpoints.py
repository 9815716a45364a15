"""KV-event endpoints from flags: loopback unless told otherwise."""
import pytest

from kvboost_common.kv_events.endpoints import zmq_endpoint


def test_forms():
    assert zmq_endpoint("5557") == "tcp://127.0.0.1:5557"
    assert zmq_endpoint("0.0.0.0:5557") == "tcp://0.0.0.0:5557"
    assert zmq_endpoint("ipc:///tmp/kv") == "ipc:///tmp/kv"
    with pytest.raises(ValueError, match="PORT, HOST:PORT"):
        zmq_endpoint("host:")
