"""stats_reply: the engine's counters and the store's read mode reach ServiceStatsReply by field name."""
from __future__ import annotations

from inference_service.serving.proto_convert import stats_reply


def test_the_read_mode_and_stream_fetches_pass_through_to_the_reply() -> None:
    reply = stats_reply({"requests": 3, "read_mode": "locked_map", "stream_fetches": 0}, queue_depth=1)
    assert (reply.requests, reply.read_mode, reply.stream_fetches, reply.queue_depth) == (3, "locked_map", 0, 1)
    assert stats_reply({}, read_mode="stream", stream_fetches=2).read_mode == "stream"


def test_tier_loads_skipped_loads_and_the_tokenization_cache_reach_the_reply() -> None:
    reply = stats_reply({"tier_loads": {"l0": {"chunks": 4, "bytes": 4096, "seconds": 0.5, "loads": 2},
                                        "daemon_map": {"chunks": 1, "bytes": 1024, "seconds": 0.25, "loads": 1}},
                         "loads_skipped": 1, "load_skipped_tokens": 128, "l0_chunks_rejected": 3,
                         "tokenizer_cache_hits": 5, "tokenizer_cache_misses": 2, "tokenizer_cache_hit_tokens": 900,
                         "tokenizer_cache_bytes": 4000})
    loads = {load.tier: (load.chunks, load.bytes, load.seconds, load.loads) for load in reply.tier_loads}
    assert loads == {"l0": (4, 4096, 0.5, 2), "daemon_map": (1, 1024, 0.25, 1)}
    assert (reply.loads_skipped, reply.load_skipped_tokens, reply.l0_chunks_rejected) == (1, 128, 3)
    assert (reply.tokenizer_cache_hits, reply.tokenizer_cache_misses, reply.tokenizer_cache_hit_tokens,
            reply.tokenizer_cache_bytes) == (5, 2, 900, 4000)
