"""stats_reply: the engine's counters and the store's read mode reach ServiceStatsReply by field name."""
from __future__ import annotations

from inference_service.serving.proto_convert import stats_reply


def test_the_read_mode_and_stream_fetches_pass_through_to_the_reply() -> None:
    reply = stats_reply({"requests": 3, "read_mode": "locked_map", "stream_fetches": 0}, queue_depth=1)
    assert (reply.requests, reply.read_mode, reply.stream_fetches, reply.queue_depth) == (3, "locked_map", 0, 1)
    assert stats_reply({}, read_mode="stream", stream_fetches=2).read_mode == "stream"
