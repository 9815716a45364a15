"""The service's KV events: what L0 holds of one-segment prompts, as blocks whose token ids are the tokenizer's,
read back through the publisher's replay socket; salted and segment prompts never leave."""
from __future__ import annotations

import zmq

from inference_service.config import EngineConfig
from inference_service.engine.engine import GenerationParams
from inference_service.serving.config import ServiceConfig
from inference_service.serving.kv_events import start_kv_events
from kvboost_common.kv_events.wire import decode_batch, decode_sequence
from kvboost_keys.prompts import tokenize_prompt
from tests.conftest import pick_free_port
from tests.inference_service.engine.test_engine import make_engine, text_of_length

BLOCK_SIZE = 4


def start_publisher(engine, tenant_salt="", **flags):
    config = ServiceConfig(kv_events_endpoint=str(pick_free_port()),
                           kv_events_replay_endpoint=f"127.0.0.1:{pick_free_port()}",
                           kv_events_block_size=BLOCK_SIZE, engine=EngineConfig(tenant_salt=tenant_salt), **flags)
    return start_kv_events(config, engine)


def replayed_events(publisher) -> list[dict]:
    """Every event published so far, in order, asked of the replay socket from sequence 0."""
    publisher.flush()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(publisher.config.replay_endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        events = []
        while True:
            _, _, sequence, payload = dealer.recv_multipart()
            if decode_sequence(sequence) == -1:
                return events
            events += decode_batch(payload)[1]
    finally:
        dealer.close(0)


def stored_tokens(events: list[dict]) -> list[int]:
    return [token for event in events if event["type"] == "BlockStored" for token in event["token_ids"]]


def ask(engine, **fields):
    outcome = engine.generate(GenerationParams(max_new_tokens=2, **fields))
    engine.flush_writes()
    return outcome


def test_a_prompt_in_l0_is_published_as_its_tokenizer_ids_in_whole_blocks(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=8)
    publisher = start_publisher(engine)
    try:
        prompt = text_of_length(45)  # 5 whole chunks and a tail of 5: 11 whole blocks of 4
        ask(engine, prompt=prompt)
        events = replayed_events(publisher)
        ids = tokenize_prompt(tiny_llama[1], prompt)[0]
        assert stored_tokens(events) == ids[:44]
        assert {event["medium"] for event in events} == {"CPU"}  # L0 on a CPU is host memory
        assert events[0]["parent_block_hash"] is None
        hashes = [block for event in events for block in event["block_hashes"]]
        assert len(set(hashes)) == 11
        ask(engine, prompt=prompt)  # asked again: placed from L0, nothing new to say
        assert replayed_events(publisher) == events
    finally:
        engine.close()
        publisher.close()


def test_salted_and_segment_prompts_are_not_published(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=8)
    publisher = start_publisher(engine)
    try:
        ask(engine, prompt=text_of_length(40), cache_salt="tenant-a")
        ask(engine, segments=(text_of_length(24), "and a question about it?"))
        assert engine.stats()["l0_chunks_held"] > 0 and replayed_events(publisher) == []
    finally:
        engine.close()
        publisher.close()


def test_salted_prompts_are_published_when_the_operator_opts_in(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=8)
    publisher = start_publisher(engine, kv_events_publish_salted=True)
    try:
        prompt = text_of_length(16)
        ask(engine, prompt=prompt, cache_salt="tenant-a")
        assert stored_tokens(replayed_events(publisher)) == tokenize_prompt(tiny_llama[1], prompt)[0][:16]
    finally:
        engine.close()
        publisher.close()


def test_a_tenant_salted_service_publishes_nothing_unless_asked(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=8, tenant_salt="acme")
    try:
        assert start_publisher(engine, tenant_salt="acme") is None
        publisher = start_publisher(engine, tenant_salt="acme", kv_events_publish_salted=True)
        assert publisher is not None
        publisher.close()
    finally:
        engine.close()


def test_eviction_from_l0_removes_the_blocks(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=8, l0_bytes=3 * 8 * 512)  # three 8-token chunks of 512 B/token
    publisher = start_publisher(engine)
    try:
        first, second = text_of_length(24), "Another text entirely, twenty-four tok"[:24]
        ask(engine, prompt=first)
        stored_first = [block for event in replayed_events(publisher) for block in event["block_hashes"]]
        ask(engine, prompt=second)  # L0 makes room: the first prompt's chunks leave, leaf first
        events = replayed_events(publisher)
        removed = [block for event in events if event["type"] == "BlockRemoved" for block in event["block_hashes"]]
        assert engine.stats()["l0_chunks_evicted"] > 0 and removed
        assert set(removed) <= set(stored_first)
        assert removed[-1] == stored_first[0]  # the first block leaves last (children before their parents)
    finally:
        engine.close()
        publisher.close()
