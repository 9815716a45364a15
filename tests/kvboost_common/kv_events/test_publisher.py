"""The publisher on real ZMQ sockets: three frames per batch, sequences from 0, replay, salted chunks kept back."""
import zmq

from kvboost_common.kv_events.block_grid import block_hash
from kvboost_common.kv_events.publisher import KvEventPublisher, KvEventsConfig
from kvboost_common.kv_events.wire import decode_batch, decode_sequence
from tests.conftest import pick_free_port

SEED = b"namespace"


def make_publisher(**overrides) -> KvEventPublisher:
    config = dict(endpoint=f"tcp://127.0.0.1:{pick_free_port()}", block_size=4,
                  replay_endpoint=f"tcp://127.0.0.1:{pick_free_port()}")
    config.update(overrides)
    return KvEventPublisher(KvEventsConfig(**config), SEED, clock=lambda: 123.0)


def subscribe(publisher: KvEventPublisher) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.RCVTIMEO, 5000)
    socket.connect(publisher.config.endpoint)
    return socket


def wait_until_subscribed(publisher: KvEventPublisher, socket: zmq.Socket) -> int:
    """PUB drops what it sends before a subscription arrives: publish throwaway batches until one is read;
    returns the next sequence number."""
    socket.setsockopt(zmq.RCVTIMEO, 100)
    for attempt in range(100):
        publisher.note_prompt(SEED, [b"probe%d" % attempt], [0], [[attempt, 9, 9, 9]])  # a new block each time
        publisher.chunk_added(b"probe%d" % attempt)
        publisher.flush()
        try:
            frames = socket.recv_multipart()
            while True:
                try:
                    frames = socket.recv_multipart()
                except zmq.Again:
                    break
            socket.setsockopt(zmq.RCVTIMEO, 5000)
            return decode_sequence(frames[1]) + 1
        except zmq.Again:
            continue
    raise AssertionError("the subscription never arrived")


def test_batches_are_three_frames_with_rising_sequences():
    publisher = make_publisher(topic="kv@pod@model")
    socket = subscribe(publisher)
    try:
        first = wait_until_subscribed(publisher, socket)
        publisher.note_prompt(SEED, [b"a", b"b"], [0, 4], [[1, 2, 3, 4], [5, 6, 7, 8]])
        publisher.chunk_added(b"a")
        publisher.flush()
        publisher.chunk_added(b"b")
        publisher.chunk_removed(b"a")
        publisher.flush()
        topic, sequence, payload = socket.recv_multipart()
        assert (topic, decode_sequence(sequence)) == (b"kv@pod@model", first)
        h_a = block_hash(None, (1, 2, 3, 4), SEED)
        h_b = block_hash(h_a, (5, 6, 7, 8), SEED)
        assert decode_batch(payload) == (123.0, [{"type": "BlockStored", "block_hashes": [h_a],
                                                  "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                                                  "block_size": 4, "lora_id": None, "medium": "GPU",
                                                  "lora_name": None}], None)
        topic, sequence, payload = socket.recv_multipart()
        assert decode_sequence(sequence) == first + 1
        # b connected, then a left with it: one batch, in the order they happened
        events = decode_batch(payload)[1]
        assert [event["type"] for event in events] == ["BlockStored", "BlockRemoved"]
        assert events[1]["block_hashes"] == [h_b, h_a]
    finally:
        socket.close(0)
        publisher.close()


def test_replay_answers_from_the_ring_and_ends_with_minus_one():
    publisher = make_publisher()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        for index in range(3):  # nobody subscribed: the batches are only in the ring
            publisher.note_prompt(SEED, [bytes([index])], [0], [[index] * 4])
            publisher.chunk_added(bytes([index]))
            publisher.flush()  # one batch each
        publisher.clear()
        publisher.flush()
        dealer.connect(publisher.config.replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = [dealer.recv_multipart() for _ in range(3)]
        assert [decode_sequence(frames[2]) for frames in replies] == [1, 2, 3]  # 0 was before the start asked
        assert all(frames[:2] == [b"", b""] for frames in replies)  # empty delimiter, then the topic ""
        assert decode_batch(replies[2][3])[1] == [{"type": "AllBlocksCleared"}]
        assert dealer.recv_multipart() == [b"", b"", b"\xff" * 8, b""]
    finally:
        dealer.close(0)
        publisher.close()


def test_salted_prompts_are_not_announced_unless_asked():
    quiet, loud = make_publisher(), make_publisher(publish_salted=True)
    try:
        for publisher in (quiet, loud):
            publisher.note_prompt(b"salted namespace", [b"a"], [0], [[1, 2, 3, 4]])
            publisher.chunk_added(b"a")
            publisher.flush()
        assert (quiet.stats.batches_sent, loud.stats.batches_sent) == (0, 1)
    finally:
        quiet.close()
        loud.close()


def test_a_subscriber_that_never_reads_does_not_hold_the_publisher_back():
    publisher = make_publisher(high_water_mark=1)
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 1)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(publisher.config.endpoint)
    try:
        for index in range(2000):
            key = index.to_bytes(4, "big")
            publisher.note_prompt(SEED, [key], [0], [[index, 0, 0, 0] * 64])
            publisher.chunk_added(key)
            if index % 100 == 0:
                assert publisher.flush(timeout=30), "the publisher stopped at a full subscriber"
        assert publisher.flush(timeout=30)
        assert publisher.stats.batches_sent + publisher.stats.batches_dropped >= 20
    finally:
        socket.close(0)
        publisher.close()


def test_closing_says_all_blocks_cleared():
    publisher = make_publisher()
    socket = subscribe(publisher)
    try:
        following = wait_until_subscribed(publisher, socket)
        publisher.close()
        topic, sequence, payload = socket.recv_multipart()
        assert decode_sequence(sequence) == following
        assert decode_batch(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        socket.close(0)
